"""``EpisodePool``: many episodes at once on a Ray cluster, with back-pressure.

``run(episodes, agent)`` drives at most ``max_concurrent`` episodes at a time, each by
``agent(env, episode)`` on a driver thread with its own ``RemoteSandboxEnv`` (an actor on
some node, reused episode after episode). Episodes are taken from the iterable only as
slots free up, so an endless generator of tasks is fine; results come back in completion
order. The per-node limit is Ray's: each actor holds one unit of the node's sandbox
resource, so a full cluster makes new actors wait (bounded by ``start_timeout_s``) rather
than overload a node. A node lost mid-episode is survived inside the env (see
``RemoteSandboxEnv``): the agent sees a rollback, as for any failure.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from belayer_core.errors import UsageError
from belayer_env.ray.config import RayEnvConfig
from belayer_env.ray.remote_env import RemoteSandboxEnv

T = TypeVar("T")
Agent = Callable[[RemoteSandboxEnv, dict[str, Any]], T]


@dataclass
class EpisodeResult(Generic[T]):
    episode: dict[str, Any]
    """The reset options the episode ran with."""
    value: T | None
    """What the agent returned (None if it raised)."""
    error: BaseException | None
    """What the agent (or the env, e.g. a node lost too often) raised; None on success."""
    failovers: list[dict[str, Any]]
    """Node losses the episode survived (see ``RemoteSandboxEnv.failovers``)."""


class EpisodePool:
    """Runs episodes concurrently on env actors; see the module doc. Use as a context manager."""

    def __init__(self, config: RayEnvConfig, max_concurrent: int):
        if max_concurrent < 1:
            raise UsageError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.config = config
        self.max_concurrent = max_concurrent
        self._idle: queue.SimpleQueue[RemoteSandboxEnv] = queue.SimpleQueue()
        self._all: list[RemoteSandboxEnv] = []
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_concurrent, thread_name_prefix="belayer-episode")

    def run(self, episodes: Iterable[dict[str, Any]], agent: Agent[T]) -> Iterator[EpisodeResult[T]]:
        """Yield one ``EpisodeResult`` per episode, as they finish (never more than
        ``max_concurrent`` in flight; the iterable is read lazily)."""
        source = iter(episodes)
        running: set[Future[EpisodeResult[T]]] = set()
        exhausted = False
        while running or not exhausted:
            while not exhausted and len(running) < self.max_concurrent:
                try:
                    episode = next(source)
                except StopIteration:
                    exhausted = True
                    break
                running.add(self._executor.submit(self._one, dict(episode), agent))
            if not running:
                break
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                yield fut.result()

    def _one(self, episode: dict[str, Any], agent: Agent[T]) -> EpisodeResult[T]:
        env = self._env()
        before = len(env.failovers)
        try:
            value = agent(env, episode)
        except Exception as e:  # noqa: BLE001 - a bad rollout is data, not a crash of the pool
            return EpisodeResult(episode, None, e, env.failovers[before:])
        finally:
            self._idle.put(env)
        return EpisodeResult(episode, value, None, env.failovers[before:])

    def _env(self) -> RemoteSandboxEnv:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            env = RemoteSandboxEnv(self.config)
            with self._lock:
                self._all.append(env)
            return env

    @property
    def envs(self) -> list[RemoteSandboxEnv]:
        with self._lock:
            return list(self._all)

    def close(self) -> None:
        """Close every env (sandboxes, checkpoints and actors go)."""
        self._executor.shutdown(wait=True)
        for env in self.envs:
            env.close()

    def __enter__(self) -> EpisodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
