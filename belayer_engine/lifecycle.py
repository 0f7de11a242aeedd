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

from belayer_engine.router import RouterConfig


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


def engine_router_config(router: RouterConfig, model: str | None, worker_secret: str) -> RouterConfig:
    """The router's config as an engine runs it: it authenticates to the workers with the
    engine's secret, and tokenizes with the served model unless told otherwise."""
    router = router.model_copy(update={"worker_api_key": worker_secret})
    if router.tokenizer is None and model:
        router = router.model_copy(update={"tokenizer": model})
    return router
