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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from belayer_core.errors import (
    ArenaLost,
    DeviceUnhealthy,
    StaleWeightVersion,
    UsageError,
    WorkerLost,
)
from belayer_engine import worker_auth
from belayer_engine.arena.client import ArenaClient
from belayer_engine.routing import Endpoint, RoutingTable
from belayer_engine.supervisor.config import SupervisorConfig, make_backend
from belayer_engine.supervisor.processes import Proc, fence, kill_group, stop_gracefully
from belayer_engine.supervisor.slot import Slot, SlotProcesses, started_for
from belayer_engine.supervisor.weights import RetainedWeights

log = logging.getLogger(__name__)

_REARM_DELAY_S = 0.02  # a new shadow is spawned this long after a handover (off the critical path)



def private_run_dir(path: Path) -> Path:
    """Create ``path`` 0700 (logs, control and weight sockets live there); refuse an existing
    one that other users may write to, where a socket could be swapped under the engine."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o022:
        raise UsageError(f"run_dir {path} is writable by group or others (mode "
                         f"{path.stat().st_mode & 0o777:o}); use a private directory (chmod 700)")
    return path

class Supervisor:
    """Owns the processes of every slot; feeds the router's ``RoutingTable``."""

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
        self.weights = RetainedWeights()  # re-applied to a slot whose arena starts from scratch
        self._weights_lock = asyncio.Lock()  # one update at a time; a cold restart waits for it
        self._layout: tuple[dict[str, list[int]], str] | None = None  # served names/shapes, dtype
        self._changed = asyncio.Condition()
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        cfg = self.config
        if cfg.run_dir:
            run_dir = private_run_dir(Path(cfg.run_dir))
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="belayer-engine-")
            run_dir = Path(self._tmp.name)
        self.run_dir = run_dir
        self._session = aiohttp.ClientSession(headers=worker_auth.headers(self.worker_secret))
        self._procs = SlotProcesses(cfg, make_backend(cfg), run_dir, self._session, self.worker_secret)
        self.table.add_listener(self._on_router_failure)
        for i in range(cfg.workers):
            slot = Slot(name=f"w{i}", index=i, device=cfg.device_of(i), socket=run_dir / f"arena{i}.sock")
            self.slots.append(slot)
            self.table.add_slot(slot.name)
        await asyncio.gather(*(self._start_slot(s) for s in self.slots))
        self._spawn_task(self._health_loop())

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
        if self._session:
            await self._session.close()
        if self._tmp:
            self._tmp.cleanup()

    # ------------------------------------------------------------------ views and waits

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

    # ------------------------------------------------------------------ plumbing

    def _event(self, slot: Slot, kind: str, **extra) -> None:
        self.events.append({"t": time.monotonic(), "wall": time.time(), "slot": slot.name, "event": kind, **extra})
        self._spawn_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

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
        if not shadow:
            slot.cold_starts += 1
        self._event(slot, f"{proc.role}_ready", pid=proc.pid, start_s=started_for(proc))
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
            # Spawning blocks this loop for a few ms (fork + exec): let the streams that a
            # handover just resumed send their requests first.
            await asyncio.sleep(_REARM_DELAY_S)
            try:
                slot.shadow = await self._start_worker(slot, shadow=True)
            except WorkerLost as exc:
                log.warning("slot %s: shadow failed to start: %s", slot.name, exc)
                self._event(slot, "shadow_failed", reason=str(exc)[:300])
            await self._notify()

        slot.arming = asyncio.create_task(arm())

    async def _route(self, slot: Slot, proc: Proc) -> None:
        proc.role = "worker"
        slot.worker = proc
        slot.endpoint = Endpoint(slot=slot.name, url=proc.url or "", device=slot.device, pid=proc.pid)
        slot.probe_failures = 0
        await self.table.put_in_service(slot.endpoint)
        self._event(slot, "routed", pid=proc.pid)

    # ------------------------------------------------------------------ detection

    def _watch(self, slot: Slot, proc: Proc) -> None:
        async def watch() -> None:
            code = await proc.process.wait()
            if proc.fenced or self._stopping:
                return
            if proc is slot.worker:
                await self._handle_worker_failure(slot, proc, "exit", f"worker exited with {code}")
            elif proc is slot.arena:
                await self._handle_arena_failure(slot, proc, f"arena exited with {code}")
            elif proc is slot.shadow:
                slot.shadow = None
                self._event(slot, "shadow_lost", code=code)
                self._rearm(slot)

        self._spawn_task(watch())

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
                ok = await self._procs.healthy(proc)
                slot.probe_failures = 0 if ok else slot.probe_failures + 1
                if slot.probe_failures >= cfg.health_failures and proc is slot.worker:
                    self._spawn_task(self._handle_worker_failure(slot, proc, "health", "health probes failed"))

    # ------------------------------------------------------------------ recovery

    async def _handle_worker_failure(self, slot: Slot, proc: Proc, source: str, reason: str) -> None:
        cfg = self.config
        async with slot.lock:
            if slot.excluded or slot.worker is not proc or self._stopping:
                return  # already handled (several detectors saw the same failure)
            t0 = time.monotonic()
            # Replayed requests that had not produced a token on this worker: the failure may
            # be theirs (the router ends them), so it does not count against the device.
            suspects = slot.endpoint.replaying if slot.endpoint is not None else 0
            self._event(slot, "detected", source=source, reason=reason, pid=proc.pid)
            await self.table.mark_down(slot.name, reason)
            slot.worker, slot.endpoint = None, None
            # The arena check only reads the owner's state: it runs while the fence waits for
            # the reap (tearing down a CUDA process takes most of the handover); nothing
            # below touches the worker's KV before both are done.
            health = asyncio.create_task(self._arena_health(slot))
            try:
                reaped = await self._fence_for_handover(slot, proc)
            except BaseException:
                health.cancel()
                raise
            self._event(slot, "fenced", pid=proc.pid, fence_s=time.monotonic() - t0, reaped=reaped)
            if not await self._arena_ok(slot, await health):
                await self._cold_restart(slot, "arena unhealthy at handover")
                return
            if slot.promoted_at is not None and t0 - slot.promoted_at < cfg.unhealthy_window_s:
                if not suspects:
                    await self._exclude(slot, f"replacement failed again {t0 - slot.promoted_at:.2f}s after handover: {reason}")
                    return
                self._event(slot, "not_excluded", reason=f"{suspects} replayed request(s) without a token on the failed worker")
            new, path = await self._take_shadow(slot), "shadow"
            if new is None:
                path = "cold"
                try:
                    new = await self._start_worker(slot, shadow=False)
                except WorkerLost as exc:
                    await self._exclude(slot, f"no replacement could start: {exc}")
                    return
            await self._route(slot, new)
            slot.promoted_at = time.monotonic()
            slot.handovers += 1
            self._event(slot, "handover", path=path, total_s=slot.promoted_at - t0)
            self._rearm(slot)

    async def _fence_for_handover(self, slot: Slot, proc: Proc) -> bool:
        """Fence the failed worker; True when it was also reaped before returning.

        A backend whose workers share nothing writable with the shadow (``isolated_kv``)
        only needs the SIGKILL sent: the reap (CUDA teardown, ~1.5 s on a GPU) finishes in
        the background, off the handover's critical path, and is logged if it never comes.
        """
        assert self._procs is not None
        if not self._procs.backend.isolated_kv:
            await fence(proc, self.config.fence_timeout_s)
            return True
        kill_group(proc)

        async def reap() -> None:
            t0 = time.monotonic()
            try:
                await fence(proc, self.config.fence_timeout_s)
            except WorkerLost as exc:
                log.error("slot %s: %s", slot.name, exc)
                self._event(slot, "reap_failed", pid=proc.pid, reason=str(exc))
                return
            self._event(slot, "reaped", pid=proc.pid, reap_s=time.monotonic() - t0)

        task = asyncio.create_task(reap())
        self._reaps.add(task)
        task.add_done_callback(self._reaps.discard)
        return False

    async def _take_shadow(self, slot: Slot) -> Proc | None:
        """Activate the slot's shadow (awaiting one that is still arming); None if there is none."""
        assert self._procs is not None
        if slot.shadow is None and slot.arming is not None:
            with contextlib.suppress(Exception):
                await slot.arming  # a shadow about to be ready beats a cold start
        shadow, slot.shadow = slot.shadow, None
        if shadow is None or not shadow.alive:
            return None
        t0 = time.monotonic()
        try:
            took = await self._procs.promote(shadow)
        except WorkerLost as exc:
            log.warning("slot %s: shadow activation failed (%s); cold start instead", slot.name, exc)
            await fence(shadow, self.config.fence_timeout_s)
            return None
        self._event(slot, "activated", pid=shadow.pid, activate_s=took, post_s=time.monotonic() - t0)
        return shadow

    async def _arena_health(self, slot: Slot) -> tuple[dict | None, float]:
        """The arena's health answer (None: owner gone or silent) and seconds it took."""
        assert self._procs is not None
        t0 = time.monotonic()
        return await self._procs.arena_health(slot), time.monotonic() - t0

    async def _arena_ok(self, slot: Slot, checked: tuple[dict | None, float] | None = None) -> bool:
        """Owner alive and answering, the device healthy, and still the owner we started."""
        assert slot.arena is not None
        health, took = checked or await self._arena_health(slot)
        ok = bool(health) and health.get("device_ok", True) and health.get("owner_pid") in (None, slot.arena.pid)
        ok = ok and slot.arena.alive  # the owner may have died since it answered
        self._event(slot, "arena_checked", ok=ok, took_s=took, detail=(health or {}).get("device_detail"))
        return ok

    async def _fence_slot_children(self, slot: Slot) -> None:
        if slot.arming is not None:
            slot.arming.cancel()
            with contextlib.suppress(BaseException):
                await slot.arming
        for proc in (slot.worker, slot.shadow):
            if proc is not None:
                await fence(proc, self.config.fence_timeout_s)
        slot.worker = slot.shadow = slot.endpoint = None

    # ------------------------------------------------------------------ weights

    async def update_weights(self, state_dict: Mapping[str, Any], version: int | None = None) -> int:
        """Push new weights (all or some, by HF name) to every slot's arena under one
        engine-wide version and keep them for slots that start from scratch later; returns
        the version once every slot in service serves it.

        ``version``: publish this number (newer than every slot's) instead of the newest
        + 1; not newer: ``StaleWeightVersion``. A slot whose arena does not take the update
        is taken out of service and cold restarted (the restart applies everything kept
        here), so no slot in service ever serves older weights than the version returned.
        Bad names or shapes: UsageError, and no slot changed.
        """
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise UsageError("update_weights needs a non-empty mapping: HF weight name -> tensor")
        if version is not None and (type(version) is not int or version < 1):
            raise UsageError(f"version must be a positive int, got {version!r}")
        async with self._weights_lock:
            live = [s for s in self.slots if not s.excluded]
            if not live:
                raise DeviceUnhealthy("update_weights: every slot is excluded")
            seen = {s.name: await self._arena_version(s) for s in live}
            for slot in live:
                if seen[slot.name] > self.weights.version:  # pushed straight to the arena: not kept
                    log.warning("slot %s: arena serves version %d, newer than the engine's %d: an update went "
                                "straight to the arena (lost at a cold restart of the slot)",
                                slot.name, seen[slot.name], self.weights.version)
                    self._event(slot, "weights_unmanaged", arena_version=seen[slot.name],
                                engine_version=self.weights.version)
            current = max([self.weights.version, *seen.values()])
            if version is not None and version <= current:
                raise StaleWeightVersion(f"version {version} is not newer than the current {current}")
            version = current + 1 if version is None else version
            taken: list[str] = []
            for slot in live:
                try:  # bad names/shapes: UsageError from the first arena, before it changed anything
                    await asyncio.to_thread(self._arena_client(slot).update_weights, state_dict, version)
                except (ArenaLost, WorkerLost, OSError) as exc:
                    await self._restart_for_weights(slot, f"weight update v{version} failed: {exc}")
                    continue
                if not taken:  # the first arena validated names and shapes
                    self.weights.merge(state_dict, version)
                taken.append(slot.name)
                self._event(slot, "weights_updated", version=version)
            if not taken:
                raise WorkerLost(f"update_weights: no arena took version {version} (slots restart and retry)")
            return version

    async def weight_layout(self) -> tuple[dict[str, list[int]], str]:
        """HF name -> shape of every served weight, and their dtype (from an arena, once)."""
        if self._layout is None:
            errors = []
            for slot in [s for s in self.slots if not s.excluded]:
                try:
                    info = await asyncio.to_thread(self._arena_client(slot).describe)
                except (ArenaLost, OSError) as exc:
                    errors.append(f"{slot.name}: {exc}")
                    continue
                shapes = {name: list(shape) for name, (_off, shape) in info["layout"].items()}
                self._layout = (shapes, str(info["model"]["dtype"]))
                break
            else:
                raise ArenaLost(f"no arena answered for the weight layout: {errors or 'every slot is excluded'}")
        return self._layout

    async def _arena_version(self, slot: Slot) -> int:
        try:
            return int((await asyncio.to_thread(self._arena_client(slot).describe)).get("version", 0))
        except (ArenaLost, OSError, ValueError):
            return 0

    def _arena_client(self, slot: Slot) -> ArenaClient:
        return ArenaClient(str(slot.socket), timeout=self.config.start_timeout_s)

    async def _restart_for_weights(self, slot: Slot, reason: str) -> None:
        """Out of service now; cold restart (re-applies the kept weights) in the background."""
        await self.table.mark_down(slot.name, reason)
        arena = slot.arena
        if arena is not None:
            self._spawn_task(self._handle_arena_failure(slot, arena, reason))

    async def _start_arena_with_weights(self, slot: Slot) -> None:
        """Start the slot's arena and give it every update kept so far, at the current
        version. Under the weights lock from start to re-apply: an update pushed meanwhile
        would give the fresh arena a newer version without the earlier updates."""
        async with self._weights_lock:
            await self._start_arena(slot)
            tensors, version = self.weights.snapshot()
            if not tensors:
                return
            try:
                await asyncio.to_thread(self._arena_client(slot).update_weights, tensors, version)
            except (ArenaLost, OSError) as exc:
                raise WorkerLost(f"re-applying weights v{version}: {exc}") from exc
            self._event(slot, "weights_reapplied", version=version, names=len(tensors))

    async def _cold_restart(self, slot: Slot, reason: str) -> None:
        """Arena gone: restart everything of the slot (caller holds the lock)."""
        log.error("slot %s: %s; cold restart of arena and worker", slot.name, reason)
        self._event(slot, "arena_lost", reason=reason)
        await self.table.mark_down(slot.name, reason)
        await self._fence_slot_children(slot)
        if slot.arena is not None:
            await fence(slot.arena, self.config.fence_timeout_s)
        try:
            await self._start_arena_with_weights(slot)  # never the checkpoint's weights after an update
            await self._route(slot, await self._start_worker(slot, shadow=False))
        except WorkerLost as exc:
            await self._exclude(slot, f"cold restart failed (ArenaLost): {exc}")
            return
        slot.promoted_at = None
        self._event(slot, "cold_restart")
        self._rearm(slot)

    async def _handle_arena_failure(self, slot: Slot, proc: Proc, reason: str) -> None:
        async with slot.lock:
            if slot.excluded or slot.arena is not proc or self._stopping:
                return
            await self._cold_restart(slot, reason)

    async def _exclude(self, slot: Slot, reason: str) -> None:
        err = DeviceUnhealthy(f"device {slot.device} (slot {slot.name}) marked unhealthy: {reason}")
        log.error("ALERT: %s", err)
        slot.excluded = True
        self._event(slot, "excluded", reason=str(err))
        await self.table.exclude(slot.name, str(err))
        await self._fence_slot_children(slot)
        if slot.arena is not None:
            await fence(slot.arena, self.config.fence_timeout_s)
