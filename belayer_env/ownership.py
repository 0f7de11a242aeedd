"""Owner labels on containers, so containers orphaned by a crashed process can be reaped.

A container belongs to (host, pid, process start time). The start time guards against pid
reuse: a new process that happens to get the same pid does not adopt old containers.
"""

from __future__ import annotations

import os
import socket
import time

from belayer_env.config import MANAGED_LABEL

OWNER_HOST = "belayer.owner.host"
OWNER_PID = "belayer.owner.pid"
OWNER_START = "belayer.owner.start"
SANDBOX_NAME = "belayer.sandbox"
CREATED = "belayer.created"


def process_start_ticks(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19]


def owner_labels(sandbox_name: str) -> dict[str, str]:
    pid = os.getpid()
    return {
        MANAGED_LABEL: "1",
        OWNER_HOST: socket.gethostname(),
        OWNER_PID: str(pid),
        OWNER_START: process_start_ticks(pid) or "",
        SANDBOX_NAME: sandbox_name,
        CREATED: f"{time.time():.3f}",
    }


def owner_alive(labels: dict[str, str]) -> bool:
    """True when the owning process still runs (or lives on another host: not ours to judge)."""
    if labels.get(OWNER_HOST) != socket.gethostname():
        return True
    try:
        pid = int(labels.get(OWNER_PID, ""))
    except ValueError:
        return False
    start = process_start_ticks(pid)
    return start is not None and start == labels.get(OWNER_START)
