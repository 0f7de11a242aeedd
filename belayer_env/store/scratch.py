"""The capture scratch space: where the frozen part of a capture writes (CRIU's images).

CRIU writes a sandbox's memory into ``pages-*.img`` while the sandbox is frozen, so the
speed of that write is frozen time. On this project's VMs writing 53 MiB into a plain
tmpfs took 35-38 ms (one 4 KiB page allocated per 4 KiB written), into a tmpfs mounted
with ``huge=within_size`` 9-15 ms (large folios, per write; small files still take 4 KiB
each, where ``huge=always`` took 2 MiB per file): a heavy sandbox's memory dump went from
45-50 ms to 18-27 ms of its frozen window (docs/capture.md).

So the default scratch root (``/dev/shm/belayer-scratch``) becomes a tmpfs of its own with
that option, mounted once per boot by the first store that finds it empty (root only,
kernels with transparent huge pages for shmem); otherwise it stays a plain directory of
``/dev/shm``, as before. It is never unmounted (empty when idle, it costs nothing).

Mounting over a directory hides what is in it, so the mount happens only while the
directory is empty, under an exclusive ``flock``, and every scratch directory is created
under the shared one (``new_dir``): a directory is either created before the mount
(then the root is not empty and nothing is mounted) or inside it.

The lock is the scratch root directory itself (``lock``): opened without following a link,
this user's and private (``private_dir``), so no other user can plant it (a link, in a
sticky ``/dev/shm`` where root may follow links), open it or hold it. A lock file beside
the root, in the shared directory, was all three. A holder of our own (a stuck process) is
waited for ``LOCK_WAIT_S`` at most, then ``ScratchLockBusy`` names it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from belayer_core.errors import CheckpointFailed, ConfigError
from belayer_core.procfs import mount_of
from belayer_env.store import in_memory
from belayer_env.store.private_dir import ensure_private_dir

SOURCE = "belayer-scratch"
"""Mount source of the scratch tmpfs (visible in ``/proc/mounts``)."""


LOCK_WAIT_S = 10.0
"""How long a capture or a store waits for another process's hold on the scratch lock (a
mount or a mkdir takes milliseconds: a longer hold is a stuck process)."""


class ScratchLockBusy(CheckpointFailed):
    """The scratch root's lock stayed held for longer than ``LOCK_WAIT_S``; names the holder."""


@contextlib.contextmanager
def lock(root: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold the lock of the scratch root ``root`` (a ``flock`` on the directory itself)."""
    fd = _open_private(root)
    try:
        how = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = time.monotonic() + LOCK_WAIT_S
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, how | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ScratchLockBusy(f"the scratch root {root} (its own lock) has been held by "
                                          f"{_holders(os.fstat(fd))} for more than {LOCK_WAIT_S:g} s") from None
                time.sleep(pause)  # no wait-with-timeout for flock(2): poll, backing off
                pause = min(pause * 2, 0.05)
        yield
    finally:
        os.close(fd)


def prepare(root: Path) -> bool:
    """Create ``root`` (0700, ``private_dir``'s rules) and, when it is empty, mount the
    large-folio tmpfs on it.

    True when ``root`` is that tmpfs (now or already). A mount that fails leaves a plain
    directory: scratch space still works, only slower. ``ConfigError`` when ``root`` is not
    this user's to use, ``ScratchLockBusy`` when its lock stays held."""
    ensure_private_dir(root, "scratch directory")
    if is_mounted(root):
        return True
    if os.geteuid() != 0 or not in_memory.huge_supported():
        return False
    with lock(root, exclusive=True):
        if is_mounted(root):
            return True
        if any(root.iterdir()):  # another process's scratch: never hide it
            return False
        return in_memory.try_mount_tmpfs(root, None, source=SOURCE, mode="0700")


def new_dir(root: Path, name: str) -> Path:
    """``root/name`` (0700), created under the shared lock (see the module's docstring)."""
    d = root / name
    if is_mounted(root):  # mounted for good: no lock needed
        d.mkdir(mode=0o700)
        return d
    with lock(root, exclusive=False):
        d.mkdir(mode=0o700)  # by path: into the tmpfs if one was mounted while this waited
    return d


def _open_private(root: Path) -> int:
    """A read fd of the directory ``root``, never through a link: this user's and private."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        why = "is a symlink" if e.errno == errno.ELOOP else e.strerror
        raise ConfigError(f"scratch directory {root} {why}: refused") from e
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise ConfigError(f"scratch directory {root} is not this user's private directory (uid {st.st_uid}, "
                          f"mode {stat.S_IMODE(st.st_mode):04o}): refused")
    return fd


def _holders(st: os.stat_result) -> str:
    """Who holds a ``flock`` on the inode of ``st`` (from ``/proc/locks``), in words."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    pids = [f[4] for f in (line.split() for line in lines) if len(f) > 5 and f[1] == "FLOCK" and f[5] == dev]
    return ("pid " + ", pid ".join(pids)) if pids else "a process /proc/locks does not name"


def is_mounted(root: Path) -> bool:
    """Whether ``root`` is the scratch tmpfs (a mount point whose source is ``SOURCE``)."""
    return mount_options(root) is not None


def mount_options(root: Path) -> str | None:
    """The options of the scratch tmpfs mounted at ``root`` (None: not mounted)."""
    target = os.path.realpath(root)
    mount = mount_of(target)
    if mount is None or mount.source != SOURCE or mount.fstype != "tmpfs" or mount.target != target:
        return None
    return mount.options
