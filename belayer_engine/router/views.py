"""What the router tells a key holder about its workers: enough to operate it, no process or file.

A key holder is a client (a trainer process), not an operator of the host. The arena's pid
and the absolute times of its events once named its shared-memory files (issue 47), so
``/belayer/workers`` and ``/server_info`` show slots, routing, handover counts and events
with their kind, durations and age, and no pid, wall-clock or monotonic time, and no path
(``reason`` texts keep their words, paths become ``<path>``). Operators read the full
view in process (``RecoverableEngine.status()``, ``events()``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from belayer_engine.common.routing import RoutingTable

_SLOT_KEYS = ("device", "routed", "shadow_ready", "excluded", "handovers", "cold_starts")
_EVENT_KEYS = ("path", "ok", "code", "version", "names", "cloned", "reaped", "source", "arena_version",
               "engine_version")
_PATH = re.compile(r"(?:/[\w.+@=-]+){2,}/?")  # two components or more: "/health" stays a word


def redact(text: str, limit: int = 300) -> str:
    return _PATH.sub("<path>", str(text))[:limit]


def table_view(table: RoutingTable) -> dict:
    """The routing table: each slot's worker (URL, instance, device, requests in flight)."""
    raw = table.snapshot()
    return {
        "slots": {slot: None if ep is None else {k: ep[k] for k in ("url", "instance", "device", "inflight")}
                  for slot, ep in raw["slots"].items()},
        "excluded": {slot: redact(reason) for slot, reason in raw["excluded"].items()},
    }


def supervisor_view(status: dict) -> dict:
    """The supervisor's ``status()`` without pids, times and paths."""
    now = time.monotonic()
    events = []
    for e in status.get("events", []):
        out = {"event": e.get("event"), "slot": e.get("slot")}
        if isinstance(e.get("t"), int | float):
            out["age_s"] = round(now - e["t"])
        out.update({k: v for k, v in e.items()
                    if (k in _EVENT_KEYS or (k.endswith("_s") and isinstance(v, int | float)))})
        if "reason" in e:
            out["reason"] = redact(e["reason"])
        events.append(out)
    slots = {name: {k: s[k] for k in _SLOT_KEYS if k in s} for name, s in status.get("slots", {}).items()}
    return {"slots": slots, "events": events}


def workers_view(table: RoutingTable, status: Callable[[], dict] | None) -> dict:
    view = table_view(table)
    if status is not None:
        view["supervisor"] = supervisor_view(status())
    return view
