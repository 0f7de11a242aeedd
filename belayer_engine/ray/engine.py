"""``RayEngine``: one OpenAI-compatible router on the driver, engine slots on Ray nodes.

Each slot (arena + worker + shadow, see ``slot_actor``) lives in a placement group of one
bundle (``{resource: 1}``, plus one GPU where there are GPUs), so Ray puts each slot on a
node that declared room for it. The router's ``RoutingTable`` is fed by one watcher per
slot: the slot's current worker URL is put in service; a handover on the slot's node (its
shadow) shows up as a new endpoint; and when the slot's node dies, the slot is marked down
(its streams break over to the other slots, or wait for this one) and started again on
another node. In-flight requests continue token by token through the router's existing
recovery: it re-sends prompt + generated ids to whichever worker serves next.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from belayer.errors import WorkerLost
from belayer_engine import worker_auth
from belayer_engine.lifecycle import LoopEngine, engine_router_config, running
from belayer_engine.ray.slot_actor import EngineSlotActor
from belayer_engine.router import Router, RouterConfig
from belayer_engine.routing import Endpoint, RoutingTable
from belayer_engine.supervisor.config import SupervisorConfig

SLOT_RESOURCE = "belayer_engine_slot"


class RayEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slots: int = Field(default=1, ge=1)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    """What each slot runs (``workers`` is forced to 1: one slot per placement group)."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    resource: str = SLOT_RESOURCE
    """Custom resource a node declares per slot it can host."""
    gpus_per_slot: float = Field(default=0, ge=0)
    bind_node_ip: bool = True
    """Workers listen on their node's IP (the router is elsewhere); keep the cluster network private."""
    watch_s: float = Field(default=30.0, gt=0)
    """Long-poll period of a slot's endpoint watch."""


class RayEngine(LoopEngine):
    """Router + Ray-placed slots behind one ``base_url``; see the module doc."""

    def __init__(self, config: RayEngineConfig | None = None):
        super().__init__("belayer-ray-engine")
        config = config or RayEngineConfig()
        # one random secret per engine: every slot's workers answer only this router and
        # their own supervisor (it travels to the slot actors as an argument, inside Ray)
        self._worker_secret = worker_auth.new_secret()
        self.config = config.model_copy(update={"router": engine_router_config(
            config.router, config.supervisor.model, self._worker_secret)})
        self.base_url = ""
        self.events: list[dict[str, Any]] = []
        self.slots: dict[str, dict[str, Any]] = {}
        self._tasks: list[asyncio.Task] = []
        self.table: RoutingTable | None = None
        self.router: Router | None = None

    @classmethod
    @contextlib.contextmanager
    def launch(cls, config: RayEngineConfig | None = None) -> Iterator[RayEngine]:
        with running(cls(config)) as engine:
            yield engine

    # ------------------------------------------------------------------ lifecycle

    def _start_timeout_s(self) -> float:
        return self.config.supervisor.start_timeout_s * 3

    async def _start(self) -> None:
        self.table = RoutingTable()
        self.table.add_listener(self._on_failure)
        self.router = Router(self.config.router, table=self.table, status=self.status)
        self.base_url = await self.router.start() + "/v1"
        for i in range(self.config.slots):
            name = f"r{i}"
            self.slots[name] = {"actor": None, "pg": None, "where": None, "instance": None,
                                "endpoint": None, "starts": 0}
            self.table.add_slot(name)
            self._tasks.append(asyncio.create_task(self._run_slot(name)))
        await self._wait(lambda: all(s["endpoint"] is not None for s in self.slots.values()),
                         self.config.supervisor.start_timeout_s * 2, "every slot serving")

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.router:
            await self.router.stop()

    def _after_stop(self) -> None:
        for state in self.slots.values():
            self._release(state, graceful=True)

    # ------------------------------------------------------------------ one slot

    async def _run_slot(self, name: str) -> None:
        """Keep slot ``name`` served: place it, follow its endpoint, re-place it when lost."""
        state = self.slots[name]
        while True:
            try:
                await self._place(name, state)
                info = await state["actor"].start.remote()
                while True:
                    if info is not None:
                        await self._serve(name, state, info)
                    info = await state["actor"].endpoint.remote(state["instance"], self.config.watch_s)
            except asyncio.CancelledError:
                raise
            except (RayActorError, WorkerLost) as e:
                self._event(name, "slot_lost", where=state["where"], error=f"{type(e).__name__}: {str(e)[:300]}")
                state["endpoint"] = None
                await self.table.mark_down(name, "slot lost (its node or actor died)")
                self._release(state, graceful=False)

    async def _place(self, name: str, state: dict[str, Any]) -> None:
        bundle = {self.config.resource: 1}
        if self.config.gpus_per_slot:
            bundle["GPU"] = self.config.gpus_per_slot
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"belayer-{name}-{time.monotonic_ns()}")
        state["pg"] = pg
        await pg.ready()
        options: dict[str, Any] = {"num_cpus": 0, "resources": {self.config.resource: 1}}
        if self.config.gpus_per_slot:  # Ray sets CUDA_VISIBLE_DEVICES: the slot's cuda:0 is its GPU
            options["num_gpus"] = self.config.gpus_per_slot
        cls = ray.remote(EngineSlotActor).options(
            **options, max_restarts=0, max_task_retries=0, max_concurrency=8,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
        state["actor"] = cls.remote(self.config.supervisor, self.config.bind_node_ip, self._worker_secret)
        state["starts"] += 1
        state["where"] = await state["actor"].where.remote()
        self._event(name, "slot_placed", where=state["where"])

    async def _serve(self, name: str, state: dict[str, Any], info: dict[str, Any]) -> None:
        endpoint = Endpoint(slot=name, url=info["url"], pid=info["pid"], device=info.get("device", "cpu"))
        state["instance"], state["endpoint"] = info["instance"], endpoint
        await self.table.put_in_service(endpoint)
        self._event(name, "routed", url=info["url"], pid=info["pid"])

    def _on_failure(self, endpoint: Endpoint, reason: str) -> None:
        """The router saw a slot's worker fail: tell the slot (its supervisor hands over)."""
        state = self.slots.get(endpoint.slot)
        if state and state["endpoint"] is endpoint and state["actor"] is not None:
            with contextlib.suppress(Exception):
                state["actor"].report_failure.remote(state["instance"], reason)

    def _release(self, state: dict[str, Any], graceful: bool) -> None:
        actor, pg = state["actor"], state["pg"]
        state["actor"] = state["pg"] = None
        if actor is not None:
            if graceful:
                with contextlib.suppress(Exception):
                    ray.get(actor.stop.remote(), timeout=60)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    # ------------------------------------------------------------------ views

    def status(self) -> dict[str, Any]:
        return {"slots": {name: {"where": s["where"], "url": s["endpoint"].url if s["endpoint"] else None,
                                 "starts": s["starts"]} for name, s in self.slots.items()},
                "events": self.events[-200:]}

    def slot_actor(self, name: str) -> Any:
        return self.slots[name]["actor"]

    def wait_event(self, kind: str, since: float, timeout: float = 120.0) -> dict[str, Any]:
        """The first event ``kind`` at or after ``since`` (time.monotonic()), bounded."""
        def find():
            return next((e for e in self.events if e["event"] == kind and e["t"] >= since), None)

        return self.call(self._wait(find, timeout, f"event {kind!r}"), timeout=timeout + 5)

    def _event(self, slot: str, event: str, **data: Any) -> None:
        self.events.append({"t": time.monotonic(), "slot": slot, "event": event, **data})

    async def _wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            if time.monotonic() > deadline:
                raise WorkerLost(f"timed out after {timeout:g} s waiting for {what}; events: {self.events[-5:]}")
            await asyncio.sleep(0.05)
        return value
