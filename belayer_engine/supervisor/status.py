"""What the supervisor reports and what its callers wait on: ``status()``, the event log,
``wait_ready`` and ``wait_event``.

A mixin of ``Supervisor`` (the state it reads: ``config``, ``slots``, ``events``,
``_changed``, ``_spawn_task``). Every event is appended with its monotonic time and wakes
the waiters; the tests and the benchmarks read the same log.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from belayer_core.errors import WorkerLost
from belayer_engine.supervisor.slot import Slot


class StatusViews:
    """Status, events and bounded waits of the supervisor (mixed into ``Supervisor``)."""

    def status(self) -> dict:
        return {
            "slots": {
                s.name: {
                    "device": s.device,
                    "worker_pid": s.worker.pid if s.worker else None,
                    "worker_url": s.worker.url if s.worker else None,
                    "shadow_pid": s.shadow.pid if s.shadow else None,
                    "arena_pid": s.arena.pid if s.arena else None,
                    "routed": s.endpoint is not None,
                    "shadow_ready": s.shadow is not None,
                    "excluded": s.excluded,
                    "handovers": s.handovers,
                    "cold_starts": s.cold_starts,
                }
                for s in self.slots
            },
            "events": self.events[-200:],
        }

    def _settled(self, stable: bool) -> bool:
        now = time.monotonic()
        for s in self.slots:
            if s.excluded:
                continue
            if s.lock.locked() or s.endpoint is None or (self.config.shadow and s.shadow is None):
                return False
            if stable and s.promoted_at is not None and now - s.promoted_at < self.config.unhealthy_window_s:
                return False
        return True

    async def wait_ready(self, timeout: float, stable: bool = False) -> None:
        """Wait until every usable slot serves and has a shadow armed.

        ``stable`` also waits out the unhealthy window, so that the next failure is
        treated as a fresh one rather than as a repeated failure of the device.
        """
        await self._wait(lambda: self._settled(stable), timeout, lambda: f"engine not ready: {self.status()['slots']}")

    async def wait_event(self, kind: str, since: float, timeout: float) -> dict:
        """The first event ``kind`` at or after monotonic time ``since`` (bounded wait)."""
        def find():
            return next((e for e in self.events if e["event"] == kind and e["t"] >= since), None)

        return await self._wait(find, timeout, lambda: f"no {kind!r} event; last events: {self.events[-5:]}")

    async def _wait(self, predicate, timeout: float, failure):
        deadline = time.monotonic() + timeout
        async with self._changed:
            while not (value := predicate()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerLost(f"after {timeout:.0f}s: {failure()}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.2))
            return value

    # ------------------------------------------------------------------ events

    def _event(self, slot: Slot, kind: str, **extra) -> None:
        self._engine_event(kind, slot=slot.name, **extra)

    def _engine_event(self, kind: str, slot: str | None = None, **extra) -> None:
        self.events.append({"t": time.monotonic(), "wall": time.time(), "slot": slot, "event": kind, **extra})
        self._spawn_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
