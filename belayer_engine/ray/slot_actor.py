"""``EngineSlotActor``: one engine slot (arena + worker + shadow) on one Ray node.

The actor runs a ``Supervisor`` of one slot in its own event loop: the arena, worker and
shadow are its child processes, so they share the node (and its shared memory and GPU)
by construction, and every recovery on a live node (worker death -> shadow handover)
stays the node's. The driver's router learns the slot's current worker from
``endpoint()`` (a long poll) and tells the slot what it saw fail through
``report_failure()``. ``apply_weights()`` brings the slot's arena to the engine's weight
version from the update patches the driver keeps in Ray's object store (only the patches
it lacks; all of them for an arena it has not seen, e.g. after a cold restart).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any

from belayer_core.errors import ArenaLost, WorkerLost
from belayer_engine.arena.client import ArenaClient
from belayer_engine.common.routing import RoutingTable
from belayer_engine.supervisor import Supervisor
from belayer_engine.supervisor.config import SupervisorConfig

POLL_S = 0.02


class EngineSlotActor:
    def __init__(self, config: SupervisorConfig, bind_node_ip: bool = True, worker_secret: str | None = None):
        import ray

        if config.workers != 1:
            config = config.model_copy(update={"workers": 1})
        if bind_node_ip:  # the router runs elsewhere: the worker must listen on the node's address
            config = config.model_copy(update={"host": ray.util.get_node_ip_address()})
        self.config = config
        self.worker_secret = worker_secret  # the driver's router holds the same one
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="belayer-slot", daemon=True)
        self._thread.start()
        self.table: RoutingTable | None = None
        self.supervisor: Supervisor | None = None
        self._applied: tuple[str, int] | None = None  # (arena id, version) this actor brought it to
        self._weights_lock = threading.Lock()

    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "host": socket.gethostname()}

    def start(self) -> dict[str, Any]:
        """Start arena, worker and shadow; return the serving endpoint once it is ready."""
        async def _start() -> None:
            self.table = RoutingTable()
            self.supervisor = Supervisor(self.config, self.table, self.worker_secret)
            await self.supervisor.start()
            await self.supervisor.wait_ready(self.config.start_timeout_s)

        self._call(_start(), self.config.start_timeout_s * 2)
        endpoint = self.endpoint(None, self.config.start_timeout_s)
        assert endpoint is not None
        return endpoint

    def endpoint(self, after: int | None, timeout_s: float) -> dict[str, Any] | None:
        """The slot's live endpoint once it is not instance ``after`` (None after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            current = self._current()
            if current is not None and current["instance"] != after:
                try:  # lets the driver skip a catch-up call when the slot is current
                    current["weight_version"] = self.weight_version()
                except (WorkerLost, ArenaLost):
                    current["weight_version"] = None
                return current
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)

    def apply_weights(self, version: int, patches: list[tuple[int, Any]]) -> int:
        """Bring the arena to engine version ``version``; return the version it serves.

        ``patches``: (version, ObjectRef of {HF name: CPU tensor}) oldest first, together
        the newest value of every updated weight. An arena this actor brought to version
        v gets the patches newer than v; any other (a fresh arena, at 0) gets them all,
        merged into one update published as ``version``: every slot reports the engine's
        version for the same weights.
        """
        import ray

        with self._weights_lock:
            arena = ArenaClient(self._arena_socket())
            info = arena.describe()
            arena_id, current = str(info["arena_id"]), int(info["version"])
            if current == version:
                return current
            if current > version:
                raise WorkerLost(f"arena {arena_id} serves version {current}, newer than the engine's {version}")
            incremental = self._applied == (arena_id, current)
            merged: dict[str, Any] = {}
            for v, ref in patches:
                if not incremental or v > current:
                    merged.update(ray.get(ref))
            served = arena.update_weights(merged, version=version)
            self._applied = (arena_id, served)
            return served

    def layout(self) -> dict[str, list[int]]:
        """HF name -> shape of every weight the arena holds (the driver checks updates with it)."""
        return {k: list(v[1]) for k, v in ArenaClient(self._arena_socket()).describe()["layout"].items()}

    def weight_version(self) -> int:
        """The version the slot's arena serves (every attached worker confirmed it)."""
        return int(ArenaClient(self._arena_socket()).describe()["version"])

    def report_failure(self, instance: int, reason: str) -> None:
        """The router saw endpoint ``instance`` fail: the supervisor fences it and hands over."""
        async def _report() -> None:
            for ep in self.table.endpoints():
                if ep.instance == instance and not ep.lost:
                    self.table.report_failure(ep, reason)

        self._call(_report(), 30)

    def pids(self) -> list[int]:
        """This actor and its arena, worker and shadow (what a lost machine takes with it)."""
        async def _pids() -> list[int]:
            slot = self.supervisor.status()["slots"]["w0"]
            return [p for p in (slot["arena_pid"], slot["worker_pid"], slot["shadow_pid"]) if p]

        return [os.getpid(), *self._call(_pids(), 30)]

    def status(self) -> dict[str, Any]:
        async def _status() -> dict[str, Any]:
            return self.supervisor.status()

        return self._call(_status(), 30)

    def stop(self) -> None:
        if self.supervisor is not None:
            self._call(self.supervisor.stop(), 60)
        self._loop.call_soon_threadsafe(self._loop.stop)

    def _arena_socket(self) -> str:
        if self.supervisor is None or not self.supervisor.slots:
            raise WorkerLost("the slot has not started")
        return str(self.supervisor.slots[0].socket)

    def _current(self) -> dict[str, Any] | None:
        async def _read() -> dict[str, Any] | None:
            live = [e for e in self.table.endpoints() if not e.lost] if self.table else []
            if not live:
                return None
            return {"url": live[0].url, "pid": live[0].pid, "instance": live[0].instance, "device": live[0].device}

        return self._call(_read(), 30)

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)
