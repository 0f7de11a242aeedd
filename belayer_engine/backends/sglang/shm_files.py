"""Shared-memory files that SIGKILLed SGLang servers leave in /dev/shm (torch-free).

SGLang's load-snapshot files (``sglang_loads_*.shm``) carry no owner pid, and its
pid-stamped segments (``sgl_shm_<kind>_<pid>_<rand>``) are unlinked only by SGLang's own
CI sweep. Python's multiprocessing semaphores (``sem.mp-*``: a spawned SGLang rank's locks)
are unlinked by the server's resource tracker, which a SIGKILL of the group takes with it.
A file is orphaned when no live process has it open or mapped (every user of a named
semaphore maps it); ``belayer gc`` removes those.
"""

from __future__ import annotations

import os
from pathlib import Path

from belayer_engine.arena.shm_files import unlink_all

SHM_DIR = Path("/dev/shm")
PREFIXES = ("sglang_loads_", "sgl_shm_", "sem.mp-")


def _in_use() -> set[int]:
    """The inodes of every /dev/shm file some process has open or mapped now (by inode: a
    named semaphore is mapped under the temporary name it was created as)."""
    used: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            with open(proc / "maps") as fh:
                used.update(int(line.split(None, 5)[4]) for line in fh if "/dev/shm/" in line)
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for fd in fds:  # one closed meanwhile must not hide the others
            try:
                if os.readlink(fd).startswith("/dev/shm/"):
                    used.add(os.stat(fd).st_ino)
            except OSError:
                continue
    return used


def orphaned() -> list[Path]:
    if not SHM_DIR.is_dir():
        return []
    candidates = []
    for p in sorted(SHM_DIR.iterdir()):
        if p.name.startswith(PREFIXES):
            try:
                candidates.append((p, p.stat().st_ino))
            except OSError:
                continue
    if not candidates:
        return []
    used = _in_use()
    return [p for p, inode in candidates if inode not in used]


def reap_orphans() -> list[str]:
    return unlink_all(orphaned())
