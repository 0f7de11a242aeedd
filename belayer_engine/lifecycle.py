"""The lifecycle both engines share (``RecoverableEngine``, ``RayEngine``).

An engine runs its own asyncio loop on a daemon thread, so plain synchronous code and async
code can both use it. ``start`` runs the engine's ``_start`` there and undoes a half start;
``stop`` runs ``_stop``, then ``_after_stop``, and ends the thread; ``running`` is the
``with`` form of the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import TypeVar

from belayer_core.errors import ConfigError
from belayer_engine.router import RouterConfig
from belayer_engine.supervisor.config import SupervisorConfig


class LoopEngine:
    """Base of an engine whose parts live on its own event loop thread."""

    def __init__(self, thread_name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=thread_name, daemon=True)

    # what an engine defines
    def _start_timeout_s(self) -> float:
        raise NotImplementedError

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    def _after_stop(self) -> None:
        """Synchronous clean-up once ``_stop`` ran (or failed), before the loop ends."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread.start()
        try:
            self.call(self._start(), timeout=self._start_timeout_s())
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self.call(self._stop(), timeout=60)
        self._after_stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def call(self, coro, timeout: float | None = None):
        """Run ``coro`` on the engine's loop from any thread and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


E = TypeVar("E", bound=LoopEngine)


@contextlib.contextmanager
def running(engine: E) -> Iterator[E]:
    """``engine`` started; stopped on exit, whatever happened."""
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def engine_router_config(router: RouterConfig, model: str | None, worker_secret: str,
                         backend: str = "reference") -> RouterConfig:
    """The router's config as an engine runs it: it authenticates to the workers with the
    engine's secret, and tokenizes with the served model unless told otherwise. SGLang
    servers of the embedded model: the router refuses ids past its vocabulary (a model
    directory's own ``config.json`` says it otherwise; the reference worker checks itself)."""
    router = router.model_copy(update={"worker_api_key": worker_secret})
    if router.tokenizer is None and model:
        router = router.model_copy(update={"tokenizer": model})
    if router.vocab_size is None and model is None and backend == "sglang":
        from belayer_engine.backends.sglang.model_dir import embedded_config

        router = router.model_copy(update={"vocab_size": embedded_config().vocab_size})
    return router


DETERMINISTIC_FLAG = "--enable-deterministic-inference"
PROCESSOR_FLAG = "--enable-custom-logit-processor"


def engine_recovery(router: RouterConfig, supervisor: SupervisorConfig) -> tuple[RouterConfig, SupervisorConfig]:
    """Match the router's recovery to the engine's workers.

    ``replay`` forces ids through SGLang's custom logit processors: the engine's SGLang
    servers then get ``--enable-custom-logit-processor`` (only the router can send one:
    clients cannot). With ``--enable-deterministic-inference`` among SGLang's worker args and
    no recovery chosen, replay is the default: a re-prefill would not give the fault-free ids
    on a GPU. The reference worker's re-prefill is already bit-exact; replay is refused there.
    """
    if supervisor.backend != "sglang":
        if router.recovery == "replay":
            raise ConfigError("recovery='replay' needs SGLang workers (backend='sglang'): it forces ids with SGLang's "
                              "custom logit processors; the reference worker's re-prefill is already bit-exact "
                              "(use recovery='token')")
        return router, supervisor
    if "recovery" not in router.model_fields_set and DETERMINISTIC_FLAG in supervisor.worker_args:
        router = router.model_copy(update={"recovery": "replay"})
    if router.recovery == "replay" and PROCESSOR_FLAG not in supervisor.worker_args:
        supervisor = supervisor.model_copy(update={"worker_args": [*supervisor.worker_args, PROCESSOR_FLAG]})
    return router, supervisor
