"""containerd's copies of restored checkpoints: removed after each restore and by ``belayer gc``.

Why: for every start from a checkpoint, containerd (1.6 here; upstream
containerd/containerd#10166) unpacks the checkpoint directory that Docker uploaded into a
fresh ``ctrd-checkpoint*`` directory of its temp dir ($XDG_RUNTIME_DIR, else $TMPDIR, else
/tmp) and never removes it. A copied-image restore leaves the whole memory dump there: on
the dev VM, three days of tests and benchmarks left 22,700 of them, 45 GB, and a training
run that rolls back thousands of times fills its disk the same way.

Each restore names the checkpoint directory it hands Docker with a nonce
(``<uuid>~<owner>``, ``write_nonce``); once the start has returned (succeeded or not),
containerd is done with its copy and ``remove`` deletes the one holding that nonce.
``sweep`` removes the copies whose owner process is gone (it died between its start and
its clean-up). Copies without a nonce are not Belayer's and are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

from belayer_core.procfs import ProcStat, processes, read_stat
from belayer_env.store.store import owner_alive, owner_tag

PREFIX = "ctrd-checkpoint"
NONCE_FILE = "belayer-nonce"
NONCE_MAX = 128  # ours are 32 hex digits, "~", pid and start ticks
LEGACY_AGE_S = 3600.0
"""A nonce without an owner was written by an older Belayer: its restore ended long before
this age (a restore is bounded by ``restore.RUNNING_TIMEOUT_S``)."""

_temp_dirs: dict[int, Path] = {}
_temp_dirs_lock = threading.Lock()


def write_nonce(images_dir: Path) -> str:
    """Give the checkpoint directory Docker will upload a nonce of its own; it also gives the
    upload a digest of its own (two restores of one checkpoint at once: "already exists")."""
    nonce = f"{uuid.uuid4().hex}~{owner_tag()}"
    (images_dir / NONCE_FILE).write_text(nonce)
    return nonce


def temp_dirs() -> list[Path]:
    """The temp dirs of the containerd processes on this host (Docker's own and a system
    one). Empty where none is visible (not root, or another pid namespace): then there is
    nothing here to clean."""
    with _temp_dirs_lock:
        if not _temp_dirs or not all(_is_containerd(read_stat(pid)) for pid in _temp_dirs):
            _temp_dirs.clear()
            for proc in processes():
                if _is_containerd(proc):
                    with contextlib.suppress(OSError):
                        _temp_dirs[proc.pid] = _temp_dir_of(proc.pid)
        return sorted(set(_temp_dirs.values()))


def remove(nonce: str) -> list[Path]:
    """Delete containerd's copies of the checkpoint directory that held ``nonce``."""
    return [_rmtree(d) for d, found in copies() if found == nonce]


def sweep(*, dry_run: bool = False) -> list[Path]:
    """Delete (``dry_run``: list) the copies Belayer restores left behind: their owner is dead."""
    now = time.time()
    stale = [d for d, nonce in copies() if nonce and _orphaned(d, nonce, now)]
    return stale if dry_run else [_rmtree(d) for d in stale]


def _orphaned(d: Path, nonce: str, now: float) -> bool:
    if "~" in nonce:
        return not owner_alive(nonce)
    with contextlib.suppress(OSError):
        return now - d.stat().st_mtime > LEGACY_AGE_S
    return False


def copies() -> list[tuple[Path, str]]:
    """Every ``ctrd-checkpoint*`` directory with its nonce ("" when it has none)."""
    out = []
    for tmp in temp_dirs():
        with contextlib.suppress(OSError):
            for entry in os.scandir(tmp):
                if entry.name.startswith(PREFIX) and entry.is_dir(follow_symlinks=False):
                    out.append((Path(entry.path), _read_nonce(Path(entry.path) / NONCE_FILE)))
    return out


def _read_nonce(path: Path) -> str:
    """The nonce in ``path``, "" when there is none. At most ``NONCE_MAX`` bytes are read and
    a symlink is not followed: the temp dir may be /tmp, where anyone can make such a file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        return os.read(fd, NONCE_MAX).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    finally:
        os.close(fd)


def _is_containerd(proc: ProcStat | None) -> bool:
    return proc is not None and proc.comm == "containerd"


def _temp_dir_of(pid: int) -> Path:
    """Where containerd makes its copies: ``os.MkdirTemp($XDG_RUNTIME_DIR, ...)``, and Go's
    temp dir ($TMPDIR, else /tmp) when that is empty."""
    env = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item)
    chosen = env.get(b"XDG_RUNTIME_DIR") or env.get(b"TMPDIR") or b"/tmp"
    path = Path(os.fsdecode(chosen))
    if os.path.samefile(f"/proc/{pid}/root", "/"):
        return path
    return Path(f"/proc/{pid}/root") / str(path).lstrip("/")  # containerd in a root of its own


def _rmtree(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)
    return d
