"""Engine-wide weight versions: every slot, its shadow and any cold restart serve one version.

Held by the supervisor: ``update_weights`` pushes to every slot's arena under one version
and keeps a host copy (``retained.py``) that a slot restarted from scratch gets before a
worker is routed to it. The weight endpoint, ``RecoverableEngine.update_weights`` and
SGLang's ``/update_weights_*`` routes on the router all come here. What it needs of the
supervisor (its slots, a cold restart, an arena start, the event log) it is handed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from belayer_core.errors import (
    ArenaLost,
    DeviceUnhealthy,
    StaleWeightVersion,
    UsageError,
    WorkerLost,
)
from belayer_engine.arena.client import ArenaClient
from belayer_engine.weights.retained import RetainedWeights

log = logging.getLogger("belayer_engine.supervisor.supervisor")


class WeightSlot(Protocol):
    """What weight sync reads of a supervisor's slot."""

    name: str
    socket: Path  # the slot's arena
    excluded: bool


class WeightSync:
    """Weight updates and their re-application on cold restarts, for the supervisor's slots.

    ``slots``: the slots now; ``restart(slot, reason)``: take it out of service and cold
    restart it in the background; ``start_arena(slot)``: start its arena process;
    ``event(slot, kind, **fields)``: the supervisor's event log.
    """

    def __init__(self, slots: Callable[[], list[WeightSlot]], arena_timeout_s: float,
                 restart: Callable[[WeightSlot, str], Awaitable[None]],
                 start_arena: Callable[[WeightSlot], Awaitable[None]],
                 event: Callable[..., None]) -> None:
        self._slots, self._timeout_s = slots, arena_timeout_s
        self._restart, self._start_arena, self._event = restart, start_arena, event
        self.weights = RetainedWeights()  # re-applied to a slot whose arena starts from scratch
        self._lock = asyncio.Lock()  # one update at a time; a cold restart waits for it
        self._layout: tuple[dict[str, list[int]], str] | None = None  # served names/shapes, dtype

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
        async with self._lock:
            live = [s for s in self._slots() if not s.excluded]
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
                    await self._restart(slot, f"weight update v{version} failed: {exc}")
                    continue
                if not taken:  # the first arena validated names and shapes; a copy of GBs: off the loop
                    await asyncio.to_thread(self.weights.merge, state_dict, version)
                taken.append(slot.name)
                self._event(slot, "weights_updated", version=version)
            if not taken:
                raise WorkerLost(f"update_weights: no arena took version {version} (slots restart and retry)")
            return version

    async def weight_layout(self) -> tuple[dict[str, list[int]], str]:
        """HF name -> shape of every served weight, and their dtype (from an arena, once)."""
        if self._layout is None:
            errors = []
            for slot in [s for s in self._slots() if not s.excluded]:
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

    async def _arena_version(self, slot: WeightSlot) -> int:
        try:
            return int((await asyncio.to_thread(self._arena_client(slot).describe)).get("version", 0))
        except (ArenaLost, OSError, ValueError):
            return 0

    def _arena_client(self, slot: WeightSlot) -> ArenaClient:
        return ArenaClient(str(slot.socket), timeout=self._timeout_s)

    async def start_arena_with_weights(self, slot: WeightSlot) -> None:
        """Start the slot's arena and give it every update kept so far, at the current
        version. Under the weights lock from start to re-apply: an update pushed meanwhile
        would give the fresh arena a newer version without the earlier updates."""
        async with self._lock:
            await self._start_arena(slot)
            tensors, version = self.weights.snapshot()
            if not tensors:
                return
            try:
                await asyncio.to_thread(self._arena_client(slot).update_weights, tensors, version)
            except (ArenaLost, OSError) as exc:
                raise WorkerLost(f"re-applying weights v{version}: {exc}") from exc
            self._event(slot, "weights_reapplied", version=version, names=len(tensors))
