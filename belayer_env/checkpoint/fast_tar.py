"""The ``tar`` CRIU runs to dump each tmpfs inside the freeze, made cheap.

Why: CRIU dumps every tmpfs of a container (Docker's ``/dev``, ``/dev/shm``,
``/sys/fs/cgroup``, the masked ``/sys/firmware`` and ``/proc/acpi``, the sandbox's
``/run/belayer``) by running ``tar --create --gzip``, and GNU tar runs ``sh -c gzip``: three
dynamically linked programs per mount, 4-6 ms each on the 2-core VM here, ~25 ms of every
frozen window for six trees of a few kilobytes. ``scripts/native/criu_tar.c`` is a static
program that writes the same archive in-process (GNU format, byte for byte what GNU tar
writes; zlib level 1, so the restore's ``tar --extract --gzip`` reads it unchanged) in
~0.7 ms, and hands every command line or tree it does not write exactly so (sockets, hard
links, sparse files, long names) to the real tar, before writing a byte.

``install()`` (``bash scripts/setup.sh``, or ``python3 belayer_env/checkpoint/fast_tar.py``)
builds it into ``HELPER`` only if its archive of a sample tree is byte-identical to the host
tar's; otherwise it removes any old build and says why. Dumps put ``DIR`` first in the PATH
of runc and CRIU (``runtime.dump``; ``BELAYER_CRIU_FAST_TAR=0`` turns that off), where it
shadows nothing but ``tar``. Restores are untouched (Docker runs them, with GNU tar).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

DIR = Path("/usr/local/libexec/belayer-criu-tar")
HELPER = DIR / "tar"
SOURCE = Path(__file__).resolve().parents[2] / "scripts" / "native" / "criu_tar.c"
CRIU_ARGS = ("--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system", "--check-links",
             "--preserve-permissions", "--sparse", "--numeric-owner", "--directory", "/proc/self/fd/0", ".")
"""What CRIU 4.x runs (``tmpfs_dump`` in criu/filesystems.c), the mount's root on stdin."""


class BuildError(RuntimeError):
    """The helper could not be built or does not write what the host's tar writes."""


def installed() -> bool:
    return os.access(HELPER, os.X_OK)


def dump_path(path: str | None) -> str:
    """``path`` (a PATH value) with the helper's directory first."""
    return f"{DIR}:{path or os.defpath}"


def real_tar() -> str:
    found = shutil.which("tar", path=os.environ.get("PATH", os.defpath).replace(f"{DIR}:", ""))
    if not found:
        raise BuildError("no tar on PATH")
    return os.path.realpath(found)


def build(out: Path, tar: str | None = None, source: Path = SOURCE) -> None:
    """Compile the helper (static, zlib) into ``out``; it hands over to ``tar``."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildError("no gcc (apt-get install build-essential zlib1g-dev)")
    tar = tar or real_tar()
    r = subprocess.run([gcc, "-O2", "-Wall", "-static", f'-DREAL_TAR="{tar}"', "-o", str(out), str(source), "-lz"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"gcc failed on {source.name}: {r.stderr.strip()[-400:]}")


def archive(program: str, root: Path, args: tuple[str, ...] = CRIU_ARGS) -> bytes:
    """What ``program`` writes for ``root`` when run the way CRIU runs tar (gzip'd bytes)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        r = subprocess.run(["tar", *args], executable=program, stdin=fd, capture_output=True, cwd="/")
    finally:
        os.close(fd)
    if r.returncode != 0:
        raise BuildError(f"{program} failed ({r.returncode}): {r.stderr.decode(errors='replace').strip()[-300:]}")
    return r.stdout


def took_fast_path(gz: bytes) -> bool:
    """zlib marks level 1 in the gzip header's XFL byte (4); GNU gzip's default level leaves 0."""
    return len(gz) > 9 and gz[:2] == b"\x1f\x8b" and gz[8] == 4


def make_sample(root: Path) -> None:
    """A tree of every kind the helper writes itself (devices only where mknod is allowed)."""
    (root / "d" / "e").mkdir(parents=True)
    (root / "sticky").mkdir(mode=0o1777)
    os.chmod(root / "sticky", 0o1777)
    (root / "d" / "f").write_bytes(b"belayer\n")
    (root / "d" / "e" / "g").write_bytes(bytes(range(256)) * 9)
    (root / "empty").write_bytes(b"")
    (root / "block").write_bytes(b"\0" * 512)
    os.chmod(root / "block", 0o4750)
    os.symlink("../d/f", root / "d" / "e" / "link")
    os.mkfifo(root / "fifo", 0o640)
    with contextlib.suppress(PermissionError):
        os.mknod(root / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    with contextlib.suppress(PermissionError):
        os.chown(root / "d" / "f", 1000, 65534)
    for i, p in enumerate(sorted(root.rglob("*"), reverse=True)):
        os.utime(p, (1_000_000_000 + i, 1_000_000_000 + i), follow_symlinks=False)


def check(helper: Path = HELPER, tar: str | None = None) -> str:
    """Why ``helper`` must not be used, or "" when it writes what ``tar`` writes and takes
    its own path for the sample tree, and hands a tree it does not write to ``tar``."""
    tar = tar or real_tar()
    with tempfile.TemporaryDirectory(prefix="belayer-fast-tar-") as tmp:
        root = Path(tmp) / "tree"
        root.mkdir()
        make_sample(root)
        ours = archive(str(helper), root)
        if not took_fast_path(ours):
            return "it handed the sample tree to the real tar"
        if gzip.decompress(ours) != gzip.decompress(archive(tar, root)):
            return f"its archive of a sample tree differs from {tar}'s"
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.bind(str(root / "sock"))  # a socket: the real tar's business
            handed, theirs = archive(str(helper), root), archive(tar, root)
        finally:
            sock.close()
        if gzip.decompress(handed) != gzip.decompress(theirs):
            return f"a tree it hands to {tar} came out different"
    return ""


def install() -> str:
    """Build, check against the host's tar, install; say what happened."""
    tar = real_tar()
    DIR.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=DIR, prefix=".tar.")
    os.close(fd)
    try:
        build(Path(tmp), tar)
        os.chmod(tmp, 0o755)
        why = check(Path(tmp), tar)
        if why:
            HELPER.unlink(missing_ok=True)
            return f"not installed ({why}): dumps run {tar}"
        os.replace(tmp, HELPER)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return f"{HELPER}: writes what {tar} writes, in-process (hands anything else to it)"


if __name__ == "__main__":  # `python3 belayer_env/checkpoint/fast_tar.py` (scripts/setup.sh)
    try:
        print(install())
    except (BuildError, OSError) as e:
        print(f"fast tar: {e}", file=sys.stderr)
        sys.exit(2)
