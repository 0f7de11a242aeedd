"""The arena's POSIX shared-memory files, and reaping those whose arena died (torch-free:
``belayer gc`` uses it)."""

from __future__ import annotations

import os
from pathlib import Path

# BELAYER_SHM_DIR: another directory (tests use a private one, out of reach of the reapers
# of every other arena on the machine).
SHM_DIR = Path(os.environ.get("BELAYER_SHM_DIR") or ("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"))
SHM_PREFIX = "belayer-arena-"


def shm_path(name: str, pid: int | None = None) -> Path:
    """The file of region ``name`` of the arena process ``pid`` (default: this one)."""
    return SHM_DIR / f"{SHM_PREFIX}{os.getpid() if pid is None else pid}-{name}"


def orphaned() -> list[Path]:
    """Shm files whose owning arena process is gone (a SIGKILLed arena leaves them behind)."""
    out = []
    for p in sorted(SHM_DIR.glob(SHM_PREFIX + "*")):
        try:
            pid = int(p.name[len(SHM_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if not Path(f"/proc/{pid}").exists():
            out.append(p)
    return out


def reap_orphans() -> list[str]:
    """Remove ``orphaned()`` files; returns their paths."""
    removed = []
    for p in orphaned():
        p.unlink(missing_ok=True)
        removed.append(str(p))
    return removed
