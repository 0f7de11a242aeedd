"""Routing table: which worker serves each slot right now, and who is waiting for one.

A *slot* is a place where a worker runs (one device); an *endpoint* is one worker process
serving a slot. The supervisor swaps endpoints on handover; the router only reads the table
and reports failures. An endpoint, once lost, is never routed to again: a revived slot gets
a new endpoint (new ``instance``), so a stale stream can never be confused with a live one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from belayer_core.errors import DeviceUnhealthy, WorkerLost

log = logging.getLogger(__name__)

LOST = object()  # sentinel pushed into the queues of streams of an endpoint that is lost

_instances = itertools.count(1)


@dataclass(eq=False)
class Endpoint:
    """One worker process serving one slot."""

    slot: str
    url: str
    device: str = "cpu"
    pid: int | None = None
    instance: int = field(default_factory=lambda: next(_instances))
    lost: bool = False
    inflight: int = 0
    streams: set[asyncio.Queue] = field(default_factory=set)
    # Requests re-sent here after a worker failure that have not produced a token yet: if
    # this endpoint fails now, the failure may be theirs (a request that kills workers),
    # not the device's, so the supervisor does not exclude the slot for it.
    replaying: int = 0

    def __repr__(self) -> str:
        return f"Endpoint({self.slot}#{self.instance} {self.url} pid={self.pid})"


FailureListener = Callable[[Endpoint, str], None]


class RoutingTable:
    """Slots -> live endpoint. Must be used from the event loop that owns it."""

    def __init__(self) -> None:
        self._active: dict[str, Endpoint | None] = {}
        self._excluded: dict[str, str] = {}
        self._changed = asyncio.Condition()
        self._listeners: list[FailureListener] = []

    # ------------------------------------------------------------------ supervisor side

    def add_listener(self, listener: FailureListener) -> None:
        """Called with (endpoint, reason) once per lost endpoint (the supervisor fences it)."""
        self._listeners.append(listener)

    def add_slot(self, slot: str) -> None:
        self._active.setdefault(slot, None)

    async def put_in_service(self, endpoint: Endpoint) -> None:
        """Swap ``endpoint`` in as the server of its slot (handover or first start)."""
        old = self._active.get(endpoint.slot)
        if old is not None and old is not endpoint:
            self._lose(old, "replaced")
        self._excluded.pop(endpoint.slot, None)
        self._active[endpoint.slot] = endpoint
        async with self._changed:
            self._changed.notify_all()

    async def mark_down(self, slot: str, reason: str) -> Endpoint | None:
        """Take a slot out of routing (it is recovering); its open streams resume elsewhere."""
        old = self._active.get(slot)
        if old is not None:
            self._lose(old, reason)
            self._active[slot] = None
        async with self._changed:
            self._changed.notify_all()
        return old

    async def exclude(self, slot: str, reason: str) -> None:
        """Exclude a slot for good (unhealthy device); waiting requests go elsewhere."""
        await self.mark_down(slot, reason)
        self._active.pop(slot, None)
        self._excluded[slot] = reason
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------------ router side

    def report_failure(self, endpoint: Endpoint, reason: str) -> None:
        """The router saw ``endpoint`` fail (broken stream, refused, stalled)."""
        if endpoint.lost:
            return
        if self._active.get(endpoint.slot) is endpoint:
            self._active[endpoint.slot] = None
        self._lose(endpoint, reason)
        for listener in self._listeners:
            listener(endpoint, reason)

    async def acquire(self, timeout: float) -> Endpoint:
        """The least loaded live endpoint, waiting up to ``timeout`` for one to appear."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._changed:
            while True:
                live = [e for e in self._active.values() if e is not None and not e.lost]
                if live:
                    best = min(live, key=lambda e: (e.inflight, e.slot))
                    return best
                if not self._active:
                    raise DeviceUnhealthy(f"no usable worker: all slots excluded ({self._excluded})")
                left = deadline - loop.time()
                if left <= 0:
                    raise WorkerLost(f"no healthy worker became available within {timeout:.1f}s")
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    pass

    def snapshot(self) -> dict:
        """A JSON-able view for ``/belayer/workers`` and tests."""
        return {
            "slots": {
                slot: None
                if ep is None
                else {"url": ep.url, "pid": ep.pid, "instance": ep.instance, "device": ep.device, "inflight": ep.inflight}
                for slot, ep in self._active.items()
            },
            "excluded": dict(self._excluded),
        }

    def endpoints(self) -> list[Endpoint]:
        return [e for e in self._active.values() if e is not None]

    def _lose(self, endpoint: Endpoint, reason: str) -> None:
        if endpoint.lost:
            return
        endpoint.lost = True
        log.info("endpoint %r lost: %s", endpoint, reason)
        for queue in list(endpoint.streams):
            queue.put_nowait(LOST)
