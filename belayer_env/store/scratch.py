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
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from belayer_core.procfs import mount_of
from belayer_env.store import in_memory

SOURCE = "belayer-scratch"
"""Mount source of the scratch tmpfs (visible in ``/proc/mounts``)."""


@contextlib.contextmanager
def _locked(root: Path, how: int) -> Iterator[None]:
    fd = os.open(root.parent / f".{root.name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)


def prepare(root: Path) -> bool:
    """Create ``root`` (0700) and, when it is empty, mount the large-folio tmpfs on it.

    True when ``root`` is that tmpfs (now or already). Any failure leaves a plain
    directory: scratch space still works, only slower."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if is_mounted(root):
        return True
    if os.geteuid() != 0 or not in_memory.huge_supported():
        return False
    with _locked(root, fcntl.LOCK_EX):
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
    with _locked(root, fcntl.LOCK_SH):
        d.mkdir(mode=0o700)
    return d


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
