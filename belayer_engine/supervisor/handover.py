"""Recovery decisions of the supervisor: handover to the shadow, cold restart, exclusion.

A mixin of ``Supervisor`` (the state it uses: ``config``, ``table``, ``slots``, ``_procs``,
``_event``, ``_route``, ``_rearm``, ``_start_worker``, ``weight_sync``).
Detection lives in ``supervisor.py``; this module decides what a failure leads to:

- worker failure: detect -> fence -> check the arena -> activate the shadow -> route ->
  re-arm (no shadow ready: cold-start a worker);
- the replacement fails again within ``unhealthy_window_s``: exclude the device (unless a
  replayed request without a token may be the cause: hand over once more);
- arena failure: cold restart of arena and worker (the kept weights re-applied).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from belayer_core.errors import DeviceUnhealthy, WorkerLost
from belayer_engine.common.loop_stall import longest_stall
from belayer_engine.supervisor.processes import Proc, fence, kill_group
from belayer_engine.supervisor.slot import Slot

log = logging.getLogger("belayer_engine.supervisor.supervisor")

LOOP_WATCH_S = 0.5  # the re-sent requests' first tokens come within this after a handover


class Handover:
    """Handover, cold restart and exclusion of a slot (mixed into ``Supervisor``)."""

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
            again = slot.promoted_at is not None and t0 - slot.promoted_at < cfg.unhealthy_window_s
            # A shadow that shares nothing writable with the dead worker (isolated_kv) is
            # promoted while the arena check runs; it is routed only if the arena is fine.
            early = None
            if reaped is False and not again:
                early = asyncio.create_task(self._take_shadow(slot, proc))
            try:
                arena_ok = await self._arena_ok(slot, await health)
            except BaseException:
                await self._drop_early(early)
                raise
            if not arena_ok:
                await self._drop_early(early)
                await self._cold_restart(slot, "arena unhealthy at handover")
                return
            if again:
                if not suspects:
                    await self._exclude(slot, f"replacement failed again {t0 - slot.promoted_at:.2f}s after handover: {reason}")
                    return
                self._event(slot, "not_excluded", reason=f"{suspects} replayed request(s) without a token on the failed worker")
            new, path = (await early if early is not None else await self._take_shadow(slot, proc)), "shadow"
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
            self._spawn_task(self._watch_loop(slot))
            self._rearm(slot)

    async def _watch_loop(self, slot: Slot) -> None:
        """The re-sent requests leave from this loop: a stall of it after the handover (the
        new shadow's spawn, a blocking call) is their wait too, reported as ``loop_stall``."""
        longest, began = await longest_stall(LOOP_WATCH_S)
        self._event(slot, "loop_stall", longest_s=longest, began_s=began, watched_s=LOOP_WATCH_S)

    async def _drop_early(self, early: asyncio.Task | None) -> None:
        """A shadow promoted during the arena check that will not be routed: fenced."""
        if early is None:
            return
        with contextlib.suppress(BaseException):  # not cancelled: a half-promoted shadow would leak
            taken = await early
            if taken is not None:
                await fence(taken, self.config.fence_timeout_s)

    async def _fence_for_handover(self, slot: Slot, proc: Proc) -> bool:
        """Fence the failed worker; True when it was also reaped before returning.

        A backend whose workers share nothing writable with the shadow (``isolated_kv``)
        only needs the SIGKILL sent: the reap (CUDA teardown, ~1.5 s on a GPU) finishes in
        the background, off the handover's critical path, and is logged if it never comes.
        """
        assert self._procs is not None
        if not self._procs.backend.isolated_kv:
            await fence(proc, self.config.fence_timeout_s)
            await self._procs.reaped(proc)
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
            await self._procs.reaped(proc)  # e.g. the arena's KV pool: the successor may allocate anywhere

        task = asyncio.create_task(reap())
        self._reaps.add(task)
        task.add_done_callback(self._reaps.discard)
        return False

    async def _take_shadow(self, slot: Slot, predecessor: Proc | None = None) -> Proc | None:
        """Activate the slot's shadow (awaiting one that is still arming) in place of
        ``predecessor``; None if there is none."""
        assert self._procs is not None
        if slot.shadow is None and slot.arming is not None:
            with contextlib.suppress(Exception):
                await slot.arming  # a shadow about to be ready beats a cold start
        shadow, slot.shadow = slot.shadow, None
        if shadow is None or not shadow.alive:
            return None
        t0 = time.monotonic()
        try:
            took = await self._procs.promote(shadow, predecessor)
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

    async def _cold_restart(self, slot: Slot, reason: str) -> None:
        """Arena gone: restart everything of the slot (caller holds the lock)."""
        log.error("slot %s: %s; cold restart of arena and worker", slot.name, reason)
        self._event(slot, "arena_lost", reason=reason)
        await self.table.mark_down(slot.name, reason)
        await self._fence_slot_children(slot)
        if slot.arena is not None:
            await fence(slot.arena, self.config.fence_timeout_s)
        try:
            await self.weight_sync.start_arena_with_weights(slot)  # never the checkpoint's weights after an update
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
