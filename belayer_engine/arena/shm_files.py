"""The arena's POSIX shared-memory files, and reaping those whose arena died (torch-free:
``belayer gc`` uses it).

A file is named after its arena as ``belayer_core.procfs.OwnerId`` (pid and start time), the
one owner-liveness rule of the project: a recycled pid never keeps a dead arena's files.
A random token of the arena process follows (``belayer-arena-<pid>-<start>-<token>-<region>``):
the pid and start time are no secret, and a name that can be derived from them is one a
request could aim at (issue 47); the token makes the names unguessable.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from belayer_core.procfs import OwnerId, owner_alive

# BELAYER_SHM_DIR: another directory (tests use a private one, out of reach of the reapers
# of every other arena on the machine).
SHM_DIR = Path(os.environ.get("BELAYER_SHM_DIR") or ("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"))
SHM_PREFIX = "belayer-arena-"
_token: tuple[int, str] = (0, "")  # (pid, token): a forked child draws its own


def _process_token() -> str:
    global _token
    if _token[0] != os.getpid():
        _token = (os.getpid(), secrets.token_hex(16))
    return _token[1]


def shm_path(name: str) -> Path:
    """The file of region ``name`` of this arena process."""
    return SHM_DIR / f"{SHM_PREFIX}{OwnerId.current().to_label()}-{_process_token()}-{name}"


def orphaned() -> list[Path]:
    """Shm files whose owning arena process is gone (a SIGKILLed arena leaves them behind)."""
    out = []
    for p in sorted(SHM_DIR.glob(SHM_PREFIX + "*")):
        pid, _, rest = p.name[len(SHM_PREFIX):].partition("-")
        start = rest.partition("-")[0]
        if not pid.isdigit():
            continue  # not an arena's file
        if start.isdigit():
            dead = not owner_alive(f"{pid}-{start}")
        else:  # named by an older arena (pid only): kept while that pid runs
            dead = not Path(f"/proc/{pid}").exists()
        if dead:
            out.append(p)
    return out


def unlink_all(paths: Iterable[Path]) -> list[str]:
    """Remove ``paths`` (one already gone is fine); returns them. Every shm reaper's last step."""
    removed = []
    for p in paths:
        p.unlink(missing_ok=True)
        removed.append(str(p))
    return removed


def reap_orphans() -> list[str]:
    """Remove ``orphaned()`` files; returns their paths."""
    return unlink_all(orphaned())
