"""How the supervisor notices a failure: a process that exits, a failure the router reports,
failed health probes of an idle worker.

A mixin of ``Supervisor`` (the state it uses: ``config``, ``slots``, ``_procs``,
``_stopping``, ``_spawn_task``, ``_event``, ``_rearm``). What a failure leads to is decided in
``handover.py`` (``_handle_worker_failure``, ``_handle_arena_failure``).
"""

from __future__ import annotations

import asyncio
import contextlib

from belayer_core.errors import WorkerLost
from belayer_engine.common.proc_group import wait_exit
from belayer_engine.common.routing import Endpoint
from belayer_engine.supervisor.processes import Proc, fence
from belayer_engine.supervisor.slot import Slot


class Detection:
    """Watchers of a slot's processes, the router's reports and the health loop (mixed into
    ``Supervisor``)."""

    def _watch(self, slot: Slot, proc: Proc) -> None:
        async def watch() -> None:
            code = await proc.process.wait()
            if proc.fenced or self._stopping:
                return
            await self._on_exit(slot, proc, code, f"{proc.role} exited with {code}")

        self._spawn_task(watch())

    def _watch_members(self, slot: Slot, proc: Proc) -> None:
        """The processes a ready worker or shadow runs on besides its leader (an SGLang
        server's scheduler of every tensor-parallel rank, its detokenizer): one that exits
        is the whole group's failure (its peers would wait for it in a collective forever),
        seen at once rather than at the router's stall timeout."""
        assert self._procs is not None
        for pid, title in self._procs.members(proc).items():
            async def watch(pid: int = pid, title: str = title) -> None:
                await wait_exit(pid)
                if proc.fenced or self._stopping or not proc.alive:
                    return  # fenced, or the leader's own watch reports it
                await self._on_exit(slot, proc, None, f"{title} (pid {pid}) of {proc.name} exited")

            self._spawn_task(watch())

    async def _on_exit(self, slot: Slot, proc: Proc, code: int | None, reason: str) -> None:
        if proc is slot.worker:
            await self._handle_worker_failure(slot, proc, "exit", reason)
        elif proc is slot.arena:
            await self._handle_arena_failure(slot, proc, reason)
        elif proc is slot.shadow:
            slot.shadow = None
            self._event(slot, "shadow_lost", code=code, reason=reason)
            with contextlib.suppress(WorkerLost):  # what it started goes with it
                await fence(proc, self.config.fence_timeout_s)
                await self._procs.reaped(proc)
            self._rearm(slot)

    def _on_router_failure(self, endpoint: Endpoint, reason: str) -> None:
        for slot in self.slots:
            if slot.endpoint is endpoint and slot.worker is not None:
                self._spawn_task(self._handle_worker_failure(slot, slot.worker, "router", reason))

    async def _health_loop(self) -> None:
        """Catches stalls of idle workers (busy ones are caught by the router's stall timeout)."""
        cfg = self.config
        assert self._procs is not None
        while True:
            await asyncio.sleep(cfg.health_interval_s)
            for slot in self.slots:
                proc = slot.worker
                if proc is None or slot.lock.locked() or not proc.alive:
                    continue
                if slot.endpoint is not None and slot.endpoint.inflight:
                    slot.probe_failures = 0  # busy: the router's stall detection, which sees its progress, judges it
                    continue
                ok = await self._procs.healthy(proc)
                slot.probe_failures = 0 if ok else slot.probe_failures + 1
                if slot.probe_failures >= cfg.health_failures and proc is slot.worker:
                    self._spawn_task(self._handle_worker_failure(slot, proc, "health", "health probes failed"))
