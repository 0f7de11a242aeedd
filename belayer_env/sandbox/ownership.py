"""Owner labels on containers, so containers orphaned by a crashed process can be reaped.

A container belongs to (host, ``OwnerId``): the owner's pid and process start time, so a
new process that happens to get the same pid does not adopt old containers (the rule is
``belayer_core.procfs``'s, shared with every other leftover Belayer names).
"""

from __future__ import annotations

import socket
import time

from belayer_core.procfs import OwnerId
from belayer_env.sandbox.config import MANAGED_LABEL

OWNER_HOST = "belayer.owner.host"
OWNER_PID = "belayer.owner.pid"
OWNER_START = "belayer.owner.start"
SANDBOX_NAME = "belayer.sandbox"
CREATED = "belayer.created"


def owner_labels(sandbox_name: str) -> dict[str, str]:
    me = OwnerId.current()
    return {
        MANAGED_LABEL: "1",
        OWNER_HOST: socket.gethostname(),
        OWNER_PID: str(me.pid),
        OWNER_START: str(me.start_time),
        SANDBOX_NAME: sandbox_name,
        CREATED: f"{time.time():.3f}",
    }


def owner_alive(labels: dict[str, str]) -> bool:
    """True when the owning process still runs (or lives on another host: not ours to judge)."""
    if labels.get(OWNER_HOST) != socket.gethostname():
        return True
    owner = OwnerId.from_label(f"{labels.get(OWNER_PID, '')}-{labels.get(OWNER_START, '')}")
    return owner is not None and owner.alive()
