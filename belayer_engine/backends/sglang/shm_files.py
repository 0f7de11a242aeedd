"""Shared-memory files that SIGKILLed SGLang servers leave in /dev/shm (torch-free).

SGLang's load-snapshot files (``sglang_loads_*.shm``) carry no owner pid, and its
pid-stamped segments (``sgl_shm_<kind>_<pid>_<rand>``) are unlinked only by SGLang's own
CI sweep. A file is orphaned when no live process has it open or mapped; ``belayer gc``
removes those.
"""

from __future__ import annotations

import os
from pathlib import Path

from belayer_engine.arena.shm_files import unlink_all

SHM_DIR = Path("/dev/shm")
PREFIXES = ("sglang_loads_", "sgl_shm_")


def _in_use() -> set[str]:
    """Every /dev/shm path some process has open or mapped now."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            with open(proc / "maps") as fh:
                for line in fh:
                    if "/dev/shm/" in line:
                        used.add(line.split(None, 5)[-1].strip().removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target)
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return used


def orphaned() -> list[Path]:
    if not SHM_DIR.is_dir():
        return []
    candidates = [p for p in sorted(SHM_DIR.iterdir()) if p.name.startswith(PREFIXES)]
    if not candidates:
        return []
    used = _in_use()
    return [p for p in candidates if str(p) not in used]


def reap_orphans() -> list[str]:
    return unlink_all(orphaned())
