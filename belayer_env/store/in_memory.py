"""In-memory unpacks: a tree that only feeds ``mkfs`` or an overlay lower gets a tmpfs of its own.

A fork's shared layer copy (``shared_layer``) and its verified runtime images
(``forking``), a capped sandbox's layer unpacked by a prestage (it only feeds
``mkfs.ext4 -d``) or by a restore (copied into the capped file system afterwards): each
is unpacked into a tmpfs of its own where it fits, because creating files on Docker's
ext4 costs ~0.45 ms of kernel time per ``openat`` on these VMs (a few thousand files:
0.4-4 s, varying with whatever else writes to it; into tmpfs ~0.1 s). The price is host
memory while the tree lives, so the tmpfs is bounded (``memory_cap``): 4x the tar,
a tar of at most ``MEMORY_MAX_BYTES``, at most 1/8 of ``MemAvailable``;
``$BELAYER_FORK_LOWER`` (``auto``, ``memory``, ``disk``) overrides. Each mount names its
maker as its source (``FORK``, ``PRESTAGE``, ``RESTORE``: visible in ``/proc/mounts``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from belayer_env.sandbox import mounting

MEMORY_MAX_BYTES = 512 << 20
"""Largest ``layer.tar`` unpacked into memory (and at most 1/8 of the host's available
memory); larger ones go to Docker's disk."""
LOWER_MODE: str = os.environ.get("BELAYER_FORK_LOWER", "auto")
"""``auto`` (memory when it fits, ``memory_cap``), ``memory`` or ``disk``."""
FORK = "belayer-fork"
"""Mount source of a fork's shared layer copy and of its verified runtime images."""
PRESTAGE = "belayer-prestage"
"""Mount source of a prestage's unpacked layer (``prestaging``)."""
RESTORE = "belayer-restore"
"""Mount source of a restore's unpacked layer (``staged.unpack_layer``)."""


def memory_cap(tar_bytes: int) -> int | None:
    """The size of the tmpfs the unpack of a ``tar_bytes`` tar gets, or None (disk).

    In memory when it fits: unpacking a few thousand files onto Docker's ext4 took 0.4-4 s
    on the dev VM (file creation, its journal, other writers), into tmpfs 0.1 s. The cost
    is the tree's unpacked size in host memory while it lives (tmpfs pages of small
    files: up to 4 KiB each, hence the cap of 4x the tar's size); bounded by the cap, by
    ``MEMORY_MAX_BYTES`` and by 1/8 of ``MemAvailable``."""
    if tar_bytes > MEMORY_MAX_BYTES and LOWER_MODE != "memory":
        return None
    cap = 4 * tar_bytes + (16 << 20)
    return cap if memory_allowed(cap) else None


def memory_allowed(cap: int) -> bool:
    """Whether a tmpfs of ``cap`` bytes may hold such a tree (``LOWER_MODE``; at most 1/8 of
    the host's available memory under ``auto``; root only: it is a mount)."""
    if LOWER_MODE == "disk" or os.geteuid() != 0:
        return False
    return LOWER_MODE == "memory" or cap <= _mem_available() // 8


def _mem_available() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def try_mount_tmpfs(path: Path, size: int | None, *, source: str, mode: str = "0755") -> bool:
    """A tmpfs of ``size`` bytes (None: the kernel's default, half the RAM) at ``path``,
    ``source`` naming its maker (``FORK``, ``PRESTAGE``, ``RESTORE``, ``scratch.SOURCE``);
    False if it cannot be mounted (then: disk). Mounted with ``huge=within_size`` where the
    kernel has it: files written in large writes (CRIU's page images, copied or dumped)
    get large folios, 3-4x faster to write here (``scratch``); small files still take 4 KiB."""
    options = ([f"size={size}"] if size is not None else []) + [f"mode={mode}"]
    for extra in ([HUGE_OPTION], []) if huge_supported() else ([],):
        try:
            mounting.mount(source, path, "tmpfs", ",".join(options + extra))
            return True
        except OSError:
            continue
    return False


HUGE_OPTION = "huge=within_size"


def huge_supported() -> bool:
    """Whether tmpfs can be mounted with ``HUGE_OPTION`` here (transparent huge pages for
    shmem built in and not denied)."""
    try:
        modes = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return False
    return "within_size" in modes and "[deny]" not in modes and "[force]" not in modes


def umount(path: Path) -> None:
    """Unmount ``path`` if it is a mount point (lazily if busy: its memory goes with its last user)."""
    if not os.path.ismount(path):
        return
    try:
        mounting.umount(path)
    except OSError:
        with contextlib.suppress(OSError):
            mounting.umount(path, lazy=True)
