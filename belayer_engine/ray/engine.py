"""``RayEngine``: one OpenAI-compatible router on the driver, engine slots on Ray nodes.

Each slot (arena + worker + shadow, see ``slot_actor``) lives in a placement group of one
bundle (``{resource: 1}``, plus one GPU where there are GPUs), so Ray puts each slot on a
node that declared room for it. The router's ``RoutingTable`` is fed by one watcher per
slot: the slot's current worker URL is put in service; a handover on the slot's node (its
shadow) shows up as a new endpoint; and when the slot's node dies, the slot is marked down
(its streams break over to the other slots, or wait for this one) and started again on
another node. In-flight requests continue token by token through the router's existing
recovery: it re-sends prompt + generated ids to whichever worker serves next.

Weight updates (``update_weights``) are versioned engine-wide: the driver puts each update
in Ray's object store (a patch), and every slot's arena is brought to the engine's version
before the slot is (again) put in service, so a slot never serves stale weights: it serves
the newest version or it is not in service. A slot that cannot take an update is taken
out of service and placed again (it catches up from the patches before serving).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from belayer_core.errors import UsageError, WorkerLost
from belayer_engine.common import worker_auth
from belayer_engine.common.routing import Endpoint, RoutingTable
from belayer_engine.lifecycle import LoopEngine, engine_recovery, engine_router_config, running
from belayer_engine.ray.slot_actor import EngineSlotActor
from belayer_engine.router import Router, RouterConfig
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
        router, supervisor = engine_recovery(config.router, config.supervisor)
        config = config.model_copy(update={"router": router, "supervisor": supervisor})
        # one random secret per engine: every slot's workers answer only this router and
        # their own supervisor (it travels to the slot actors as an argument, inside Ray)
        self._worker_secret = worker_auth.new_secret()
        self.config = config.model_copy(update={"router": engine_router_config(
            config.router, config.supervisor.model, self._worker_secret, config.supervisor.backend)})
        self.base_url = ""
        self.events: list[dict[str, Any]] = []
        self.slots: dict[str, dict[str, Any]] = {}
        self._tasks: list[asyncio.Task] = []
        self.table: RoutingTable | None = None
        self.router: Router | None = None
        self.weight_version = 0
        """The engine's weight version: every slot in service serves it."""
        self._patches: list[tuple[int, frozenset[str], Any]] = []  # (version, names, ObjectRef), oldest first
        self._layout: dict[str, list[int]] | None = None  # HF name -> shape, from the first slot
        self._weights_lock: asyncio.Lock | None = None

    @classmethod
    @contextlib.contextmanager
    def launch(cls, config: RayEngineConfig | None = None) -> Iterator[RayEngine]:
        with running(cls(config)) as engine:
            yield engine

    # ------------------------------------------------------------------ lifecycle

    def _start_timeout_s(self) -> float:
        return self.config.supervisor.start_timeout_s * 3

    async def _start(self) -> None:
        self._weights_lock = asyncio.Lock()
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
        """Put the slot's endpoint in service, its weights brought to the engine's version first."""
        async with self._weights_lock:  # no update between the catch-up and the routing
            if info.get("weight_version") != self.weight_version:
                await self._bring(name, state["actor"])
            if self._layout is None:
                self._layout = await self._ask(name, state["actor"], "layout")
            endpoint = Endpoint(slot=name, url=info["url"], pid=info["pid"], device=info.get("device", "cpu"))
            state["instance"], state["endpoint"] = info["instance"], endpoint
            await self.table.put_in_service(endpoint)
        self._event(name, "routed", url=info["url"], pid=info["pid"], weight_version=self.weight_version)

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict: Mapping[str, Any], timeout: float = 600.0) -> int:
        """Push new weights (all or some, by HF name) to every slot; return the new version.

        When it returns, every slot in service serves that version (a request sent after it
        reports ``weight_version >=`` it); a slot that failed to switch is out of service and
        placed again, and a slot placed or restarted later catches up before it serves.
        The tensors travel through Ray's object store (moved to CPU here).
        """
        tensors = {str(k): v.detach().cpu().contiguous() for k, v in state_dict.items()}
        if not tensors:
            raise UsageError("update_weights needs at least one tensor")
        if self._layout is not None:
            for k, t in tensors.items():
                if k not in self._layout:
                    raise UsageError(f"unknown weight {k!r}")
                if list(t.shape) != list(self._layout[k]):
                    raise UsageError(f"{k}: shape {list(t.shape)} != {self._layout[k]}")
        ref = ray.put(tensors)
        return self.call(self._update_weights(ref, frozenset(tensors)), timeout=timeout)

    async def _update_weights(self, ref: Any, names: frozenset[str]) -> int:
        async with self._weights_lock:
            version = self.weight_version + 1
            # a patch whose every weight a newer one sets is never needed again
            self._patches = [p for p in self._patches if not p[1] <= names] + [(version, names, ref)]
            self.weight_version = version
            serving = [(n, s["actor"]) for n, s in self.slots.items() if s["endpoint"] is not None]
            results = await asyncio.gather(*(self._bring(n, a) for n, a in serving), return_exceptions=True)
            failed = []
            for (name, actor), result in zip(serving, results, strict=True):
                if isinstance(result, BaseException):
                    failed.append(name)
                    await self._take_out(name, actor, f"weight update to version {version} failed: {result}")
        self._event("*", "weights_updated", version=version, slots=[n for n, _ in serving if n not in failed],
                    failed=failed)
        return version

    async def _bring(self, name: str, actor: Any) -> None:
        """The slot's arena at the engine's version (caller holds the weights lock)."""
        served = await self._ask(name, actor, "apply_weights", self.weight_version,
                                 [(v, r) for v, _, r in self._patches])
        if served != self.weight_version:
            raise WorkerLost(f"slot {name} serves weight version {served}, not {self.weight_version}")

    async def _ask(self, name: str, actor: Any, method: str, *args: Any) -> Any:
        """Call the slot actor; what failed in the slot comes back as ``WorkerLost`` (the
        slot's watcher then places it again), a dead actor as ``RayActorError``."""
        if actor is None:
            raise WorkerLost(f"slot {name} has no actor")
        try:
            return await getattr(actor, method).remote(*args)
        except RayActorError:
            raise
        except Exception as e:  # noqa: BLE001 - the slot's arena or worker failed the call
            raise WorkerLost(f"slot {name}: {method} failed: {type(e).__name__}: {str(e)[:300]}") from e

    async def _take_out(self, name: str, actor: Any, reason: str) -> None:
        """Out of service now; killing the actor makes its watcher place the slot again.

        If the watcher already replaced ``actor`` (its node died meanwhile), the slot is out
        of service already and its new actor catches up before it serves: leave it alone.
        """
        self._event(name, "weights_failed", reason=reason[:300])
        state = self.slots[name]
        if state["actor"] is not actor:
            return
        state["endpoint"] = None
        await self.table.mark_down(name, reason)
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)

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

    def worker_headers(self) -> dict[str, str]:
        """The header that lets this process talk to the slots' workers directly (tests, tools)."""
        return worker_auth.headers(self._worker_secret)

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
