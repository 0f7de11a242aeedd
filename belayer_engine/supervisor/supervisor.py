"""The supervisor: starts arena, worker and shadow per slot and runs every recovery.

Recovery decisions for the engine half live here (the router only reports what it saw):

- worker failure (process exit, broken stream or stall reported by the router, failed
  health probes): detect -> fence (SIGKILL the process group, wait until reaped; for a
  backend with ``isolated_kv`` the reap completes in the background) -> check
  the arena -> activate the shadow (``POST /belayer/activate``: flush KV metadata, attach)
  -> swap it into the routing table -> in-flight requests resume there -> arm a new
  shadow in the background. No shadow ready: cold-start a worker instead.
- the replacement fails again within ``unhealthy_window_s``: the device is marked
  unhealthy and excluded; its requests move to the other slots; an alert is logged. Not
  when the replacement was carrying a replayed request that had not produced a token yet:
  that request may be what kills workers (the router ends it, never replays it again), so
  the slot is handed over once more instead.
- arena failure: cold restart of arena and worker; requests wait (delay, not an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from pathlib import Path

import aiohttp

from belayer_core.errors import WorkerLost
from belayer_engine.common import worker_auth
from belayer_engine.common.net import worker_connector
from belayer_engine.common.routing import Endpoint, RoutingTable
from belayer_engine.supervisor.config import SupervisorConfig, make_backend
from belayer_engine.supervisor.detection import Detection
from belayer_engine.supervisor.fork_template import template_supported
from belayer_engine.supervisor.handover import Handover
from belayer_engine.supervisor.processes import Proc, fence, stop_gracefully
from belayer_engine.supervisor.run_dir import private_run_dir, temp_run_dir
from belayer_engine.supervisor.slot import Slot, SlotProcesses, started_for
from belayer_engine.supervisor.status import StatusViews
from belayer_engine.weights.sync import WeightSync

log = logging.getLogger(__name__)

__all__ = ["Supervisor", "private_run_dir"]

_REARM_DELAY_S = 0.02  # a new shadow is spawned at least this long after a handover (off the critical path)
_REARM_WAIT_S = 1.0  # ... and once the re-sent requests have their first tokens, or this long after it
_REARM_POLL_S = 0.005
_SHADOW_START_ATTEMPTS = 3  # a shadow that fails to start is started again, after 1 s, then 2 s
_SHADOW_RETRY_S = 1.0


class Supervisor(Detection, Handover, StatusViews):
    """Owns the processes of every slot; feeds the router's ``RoutingTable``.

    Its roles live in four modules: this one (lifecycle and spawning), ``detection.py`` (how
    a failure is noticed), ``handover.py`` (every recovery decision), ``status.py`` (status,
    events, waits); engine-wide weights are ``weights.sync.WeightSync``, held here as
    ``weight_sync``.
    """

    def __init__(self, config: SupervisorConfig, table: RoutingTable, worker_secret: str | None = None) -> None:
        self.config = config
        self.table = table
        self.worker_secret = worker_secret  # closes worker endpoints to other local users
        self.events: list[dict] = []
        self.slots: list[Slot] = []
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.run_dir: Path | None = None  # logs and sockets (set by start)
        self._session: aiohttp.ClientSession | None = None
        self._procs: SlotProcesses | None = None
        self._tasks: set[asyncio.Task] = set()
        self._reaps: set[asyncio.Task] = set()  # background reaps of killed workers (isolated_kv)
        self.weight_sync = WeightSync(lambda: self.slots, config.start_timeout_s, self._restart_for_weights,
                                      self._start_arena, self._event)
        self._changed = asyncio.Condition()
        self._stopping = False

    # ------------------------------------------------------------------ weights (weight_sync)

    @property
    def weights(self):
        """The engine-wide version and the kept updates (``weights.retained.RetainedWeights``)."""
        return self.weight_sync.weights

    async def update_weights(self, state_dict, version: int | None = None) -> int:
        return await self.weight_sync.update_weights(state_dict, version=version)

    async def weight_layout(self) -> tuple[dict[str, list[int]], str]:
        return await self.weight_sync.weight_layout()

    async def _restart_for_weights(self, slot: Slot, reason: str) -> None:
        """Out of service now; cold restart (re-applies the kept weights) in the background."""
        await self.table.mark_down(slot.name, reason)
        arena = slot.arena
        if arena is not None:
            self._spawn_task(self._handle_arena_failure(slot, arena, reason))

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        cfg = self.config
        if cfg.run_dir:
            run_dir = private_run_dir(Path(cfg.run_dir))
        else:
            self._tmp = temp_run_dir()
            run_dir = Path(self._tmp.name)
        self.run_dir = run_dir
        self._session = aiohttp.ClientSession(connector=worker_connector(),
                                              headers=worker_auth.headers(self.worker_secret))
        self._procs = SlotProcesses(cfg, make_backend(cfg), run_dir, self._session, self.worker_secret)
        self.table.add_listener(self._on_router_failure)
        for i in range(cfg.workers):
            slot = Slot(name=f"w{i}", index=i, device=cfg.device_of(i), socket=run_dir / f"arena{i}.sock")
            self.slots.append(slot)
            self.table.add_slot(slot.name)
        await asyncio.gather(*(self._start_slot(s) for s in self.slots))
        self._spawn_task(self._health_loop())
        if cfg.shadow and template_supported():
            self._spawn_task(self._start_template())

    async def _start_template(self) -> None:
        """Start the backend's worker template after the slots (never on the start's path):
        later shadows and workers are its clones (``ForkTemplate``); without it they are
        spawned as before."""
        assert self._procs is not None
        template = self._procs.new_template()
        if template is None:
            return
        t0 = time.monotonic()
        try:
            await template.start(self.config.start_timeout_s)
        except WorkerLost as exc:
            log.warning("worker template failed to start (workers are spawned instead): %s", exc)
            self._engine_event("template_failed", reason=str(exc)[:300])
            return
        if self._stopping:
            await template.stop()
            return
        self._procs.template = template
        assert template.process is not None
        self._engine_event("template_ready", pid=template.process.pid, start_s=time.monotonic() - t0)

    async def stop(self) -> None:
        self._stopping = True
        arming = [s.arming for s in self.slots if s.arming]
        for task in [*self._tasks, *arming]:
            task.cancel()
        await asyncio.gather(*self._tasks, *arming, return_exceptions=True)
        await asyncio.gather(*self._reaps, return_exceptions=True)  # bounded by fence_timeout_s
        for slot in self.slots:
            for proc in (slot.worker, slot.shadow):
                if proc is not None:
                    with contextlib.suppress(WorkerLost):
                        await fence(proc, self.config.fence_timeout_s)
            if slot.arena is not None:  # a clean stop: the arena removes its /dev/shm files
                with contextlib.suppress(WorkerLost):
                    await stop_gracefully(slot.arena, self.config.fence_timeout_s)
        if self._procs is not None and self._procs.template is not None:
            await self._procs.template.stop(self.config.fence_timeout_s)
        if self._session:
            await self._session.close()
        if self._tmp:
            self._tmp.cleanup()

    # ------------------------------------------------------------------ plumbing

    def _spawn_task(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _start_arena(self, slot: Slot) -> None:
        assert self._procs is not None
        slot.arena = await self._procs.start_arena(slot)
        self._watch(slot, slot.arena)
        self._event(slot, "arena_ready", pid=slot.arena.pid, start_s=started_for(slot.arena))

    async def _start_worker(self, slot: Slot, shadow: bool) -> Proc:
        assert self._procs is not None
        proc = await self._procs.start_worker(slot, shadow)
        self._watch(slot, proc)
        self._watch_members(slot, proc)
        if not shadow:
            slot.cold_starts += 1
        self._event(slot, f"{proc.role}_ready", pid=proc.pid, start_s=started_for(proc), cloned=proc.cloned)
        return proc

    async def _start_slot(self, slot: Slot) -> None:
        async with slot.lock:
            await self._start_arena(slot)
            self._rearm(slot)
            await self._route(slot, await self._start_worker(slot, shadow=False))

    def _rearm(self, slot: Slot) -> None:
        """Start a new shadow in the background (never on the critical path)."""
        if not self.config.shadow or slot.excluded or self._stopping:
            return
        if slot.arming is not None and not slot.arming.done():
            return

        async def arm() -> None:
            # Spawning blocks this loop for a few ms (fork + exec; 10 ms seen on the CPU VM):
            # the streams a handover just resumed send their requests from it first.
            await resends_settled(slot.endpoint)
            for attempt in range(1, _SHADOW_START_ATTEMPTS + 1):
                try:
                    slot.shadow = await self._start_worker(slot, shadow=True)
                    break
                except WorkerLost as exc:
                    # e.g. a port SGLang chose was taken by the time its rank bound it: a slot
                    # without a standby would stay so, and wait_ready() would wait for nothing
                    again = attempt < _SHADOW_START_ATTEMPTS and not self._stopping and not slot.excluded
                    log.warning("slot %s: shadow failed to start (attempt %d of %d%s): %s", slot.name, attempt,
                                _SHADOW_START_ATTEMPTS, ", trying again" if again else "", exc)
                    self._event(slot, "shadow_failed", reason=str(exc)[:300], attempt=attempt, retry=again)
                    if not again:
                        break
                    await asyncio.sleep(_SHADOW_RETRY_S * attempt)
            await self._notify()

        slot.arming = asyncio.create_task(arm())

    async def _route(self, slot: Slot, proc: Proc) -> None:
        proc.role = "worker"
        slot.worker = proc
        slot.endpoint = Endpoint(slot=slot.name, url=proc.url or "", device=slot.device, pid=proc.pid)
        slot.probe_failures = 0
        await self.table.put_in_service(slot.endpoint)
        self._event(slot, "routed", pid=proc.pid)


async def resends_settled(endpoint: Endpoint | None, min_s: float = _REARM_DELAY_S, cap_s: float = _REARM_WAIT_S,
                          poll_s: float = _REARM_POLL_S) -> None:
    """Return once the requests re-sent to ``endpoint`` after a handover all have a token
    (``endpoint.replaying`` back at 0), at least ``min_s`` and at most ``cap_s`` from now: the
    router re-sends within milliseconds of the routing, and what comes after it may stall."""
    start = time.monotonic()
    await asyncio.sleep(min_s)
    while endpoint is not None and endpoint.replaying > 0 and time.monotonic() - start < cap_s:
        await asyncio.sleep(poll_s)

