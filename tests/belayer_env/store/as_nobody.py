"""Another local user for the store's trust tests: the real ``nobody`` (uid 65534) in real
processes (``setpriv``), acting on real files; never a mocked owner."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

NOBODY = 65534
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else (shutil.which("python3") or "python3")


def _setpriv() -> str:
    runner = shutil.which("setpriv")
    if os.geteuid() != 0 or runner is None:
        pytest.skip("needs root and setpriv to act as another local user (nobody)")
    return runner


def _argv(code: str, args: tuple[str, ...]) -> list[str]:
    return [_setpriv(), "--reuid=nobody", "--regid=nogroup", "--clear-groups", PYTHON, "-c", code, *args]


def as_nobody(code: str, *args: str) -> str:
    """Run Python ``code`` (``sys.argv[1:]`` = ``args``) as nobody; its stdout (it must succeed)."""
    out = subprocess.run(_argv(code, args), capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, f"nobody's part failed: {out.stderr}"
    assert os.geteuid() == 0
    return out.stdout


class NobodyHolds:
    """``code`` runs as nobody until the block ends: it prints one line when its part is done
    (what the test waits for: no sleeps), then waits for its stdin to close."""

    def __init__(self, code: str, *args: str):
        self.argv = _argv(code + "\nprint('ready', flush=True)\nimport sys\nsys.stdin.read()\n", args)

    def __enter__(self) -> NobodyHolds:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd="/")
        line = self.proc.stdout.readline()
        if line != "ready\n":
            self.proc.kill()
            pytest.fail(f"nobody's part failed: {line!r} {self.proc.communicate()[1]}")
        return self

    def release(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def __exit__(self, *exc: object) -> None:
        self.release()


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A root-owned 0755 directory in /tmp: nobody reaches it (pytest's tmp_path is 0700
    root) but cannot write it. Removed with what is in it afterwards."""
    _setpriv()
    d = Path(tempfile.mkdtemp(prefix="belayer-trust-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def made_by_nobody(path: Path, mode: int) -> Path:
    """``path`` created as a directory ``mode`` and given to nobody (as its owner would make it)."""
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, mode)
    return path
