"""Write back what background work left dirty, in the background too.

Why: on ext4 in its default ``data=ordered`` mode (Docker's disk here) an fsync waits for
the dirty data of the whole journal transaction, not only its own file. Docker and
containerd fsync during every create and start, so the 55-100 MB that a prestage (the
CRIU images, the layer's file system image) or a restore (a layer copied into a capped
file system) had written moments earlier were written back inside the next restore: a
heavy pre-staged restore took 240-330 ms that way and 210-235 ms with them written back
first. The kernel starts on its own only after ``dirty_expire_centisecs`` (30 s).
``flush_later`` writes them back (``syncfs``) on a thread as soon as the work is done.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from pathlib import Path

from belayer_env.common.background import ThreadSet

_libc = ctypes.CDLL(None, use_errno=True)
_flushing = ThreadSet("belayer-writeback")
_queued: set[tuple[str, ...]] = set()
_queued_lock = threading.Lock()


def syncfs(path: Path) -> None:
    """Write back the whole file system holding ``path`` in one call."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def flush_later(*paths: Path) -> None:
    """``syncfs`` of each path, in order, on a thread (a loop-mounted file system first,
    then the one holding its image file); a flush of the same paths that has not started
    yet covers this call too."""
    key = tuple(str(p) for p in paths)
    with _queued_lock:
        if key in _queued:
            return
        _queued.add(key)
    _flushing.start(_flush, key)


def held() -> contextlib.AbstractContextManager[None]:
    """Flushes asked for meanwhile start when it ends (``restore.cleanup_deferred``)."""
    return _flushing.held()


def wait_flushed(timeout_s: float = 120.0) -> bool:
    """Wait for the flushes started so far (benchmarks between timed calls); True when done."""
    return _flushing.wait(timeout_s)


def _flush(key: tuple[str, ...]) -> None:
    with _queued_lock:
        _queued.discard(key)  # writes from now on need a flush of their own
    for path in key:
        with contextlib.suppress(OSError):  # gone meanwhile: nothing of ours to write back there
            syncfs(Path(path))
