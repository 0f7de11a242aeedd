"""``RecoverableEngine``: router + supervisor + processes behind one ``base_url``.

The engine runs its own event loop in a background thread, so it can be used from plain
synchronous code (``with RecoverableEngine.launch() as engine:``) and from async code
alike; the arena, workers and shadows are real child processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from belayer_core.errors import UsageError
from belayer_engine.common import worker_auth
from belayer_engine.common.routing import RoutingTable
from belayer_engine.lifecycle import LoopEngine, engine_recovery, engine_router_config, running
from belayer_engine.router import Router, RouterConfig
from belayer_engine.supervisor import Supervisor
from belayer_engine.supervisor.config import SupervisorConfig
from belayer_engine.weights.endpoint import WeightsEndpoint


class RecoverableEngine(LoopEngine):
    """An OpenAI-compatible endpoint that survives worker, stall and arena failures."""

    def __init__(self, supervisor: SupervisorConfig | None = None, router: RouterConfig | None = None) -> None:
        super().__init__("belayer-engine")
        router, self.supervisor_config = engine_recovery(router or RouterConfig(), supervisor or SupervisorConfig())
        # One random secret per engine: its workers answer only the router and the supervisor.
        self._worker_secret = worker_auth.new_secret()
        self.router_config = engine_router_config(router, self.supervisor_config.model, self._worker_secret,
                                                  self.supervisor_config.backend)
        self.base_url: str = ""
        self.weights_socket: str = ""  # the weight endpoint of learners in other processes
        self.router: Router | None = None
        self.supervisor: Supervisor | None = None
        self._weights_endpoint: WeightsEndpoint | None = None

    @classmethod
    @contextlib.contextmanager
    def launch(
        cls,
        model: str | None = None,
        workers: int = 1,
        shadow: bool = True,
        device: str = "cpu",
        *,
        router: RouterConfig | None = None,
        **supervisor_options,
    ) -> Iterator[RecoverableEngine]:
        """Start arena(s), workers, shadows and the router; stop them all on exit.

        ``base_url`` ends in ``/v1`` so it can be given to ``openai.OpenAI(base_url=...)``.
        """
        config = SupervisorConfig(model=model, workers=workers, shadow=shadow, device=device, **supervisor_options)
        with running(cls(config, router)) as engine:
            yield engine

    # ------------------------------------------------------------------ lifecycle

    def _start_timeout_s(self) -> float:
        return self.supervisor_config.start_timeout_s * 2

    async def _start(self) -> None:
        # The one place the engine is wired: supervisor and router share a routing table;
        # the router reports failures into it and shows the supervisor's view.
        table = RoutingTable()
        self.supervisor = Supervisor(self.supervisor_config, table, self._worker_secret)
        self.router = Router(self.router_config, table=table, status=self.supervisor.status,
                             control=self.supervisor)
        url = await self.router.start()
        self.base_url = url + "/v1"
        await self.supervisor.start()
        assert self.supervisor.run_dir is not None
        path = Path(self.supervisor_config.weights_socket or self.supervisor.run_dir / "weights.sock")
        self._weights_endpoint = WeightsEndpoint(self.supervisor.weight_sync, path)
        await self._weights_endpoint.start()
        self.weights_socket = str(path)

    async def _stop(self) -> None:
        if self._weights_endpoint:
            await self._weights_endpoint.stop()
        if self.router:
            await self.router.stop()
        if self.supervisor:
            await self.supervisor.stop()

    # ------------------------------------------------------------------ helpers

    def wait_ready(self, timeout: float = 120.0, stable: bool = False) -> None:
        """Block until every usable slot serves with a shadow armed (see Supervisor.wait_ready)."""
        assert self.supervisor is not None
        self.call(self.supervisor.wait_ready(timeout, stable), timeout=timeout + 5)

    def wait_event(self, kind: str, since: float, timeout: float = 60.0) -> dict:
        """Block until the supervisor logs event ``kind`` at/after ``since`` (time.monotonic())."""
        assert self.supervisor is not None
        return self.call(self.supervisor.wait_event(kind, since, timeout), timeout=timeout + 5)

    def status(self) -> dict:
        assert self.supervisor is not None
        return self.call(_value(self.supervisor.status))

    def arena_socket(self, slot: int = 0) -> str:
        """The Unix socket of slot ``slot``'s arena. ``ArenaClient(...).update_weights`` there
        updates that slot alone, and a cold restart of the slot forgets it: a trainer's
        weight sync is ``update_weights`` in this process or, from another process,
        ``weights_client.EngineWeights(engine.weights_socket)`` (every slot, kept across restarts)."""
        assert self.supervisor is not None
        if not 0 <= slot < len(self.supervisor.slots):
            raise UsageError(f"no slot {slot}: this engine has {len(self.supervisor.slots)}")
        return str(self.supervisor.slots[slot].socket)

    def update_weights(self, state_dict, timeout: float | None = None, version: int | None = None) -> int:
        """Push new weights (all or some, by HF name; CPU or CUDA tensors) to every slot under
        one engine-wide version (``version`` if given: newer than the current one); returns
        it once every slot in service serves it. The engine keeps a host copy of the newest
        value of each updated tensor, so a slot restarted from scratch (its arena lost)
        serves these weights, never the checkpoint's. Another process does the same through
        ``weights_socket`` (``belayer_engine.weights.client.EngineWeights``)."""
        assert self.supervisor is not None
        return self.call(self.supervisor.update_weights(state_dict, version=version), timeout=timeout)

    def worker_headers(self) -> dict[str, str]:
        """The header that lets this process talk to the engine's workers directly (tests, tools)."""
        return worker_auth.headers(self._worker_secret)

    def worker_pid(self, slot: int = 0) -> int | None:
        return self.status()["slots"][f"w{slot}"]["worker_pid"]

    def events(self) -> list[dict]:
        assert self.supervisor is not None
        return self.call(_value(lambda: list(self.supervisor.events)))


async def _value(fn):
    return fn()
