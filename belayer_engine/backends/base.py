"""The supervisor's one seam to a kind of worker: how to start, promote and probe it.

The supervisor owns processes and recovery decisions; a backend only knows its own command
lines and HTTP routes. Everything is over HTTP (SGLang's native protocol) or argv, so the
supervisor never imports a backend's model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp


@dataclass(frozen=True)
class SlotSpec:
    """What a backend needs to know about the slot it starts processes for."""

    name: str
    device: str
    arena_socket: Path
    run_dir: Path


@dataclass(frozen=True)
class WorkerSpec:
    """One worker or shadow process to start."""

    worker_id: str
    host: str
    port: int
    shadow: bool


class WorkerBackend(Protocol):
    """One kind of inference worker (the reference worker, SGLang servers)."""

    name: str
    # True when a worker keeps its KV to itself (SGLang): its shadow may serve as soon as
    # the dead worker is SIGKILLed, without waiting for the kernel to reap it (on a GPU,
    # tearing down a CUDA context takes ~1.5 s). False when the shadow takes over KV the
    # old worker could still be writing (the reference worker's KV lives in the arena).
    isolated_kv: bool

    # The arena program (``python -m <arena_module>``): ``belayer_engine.arena``, or a backend's
    # entry point that hands the arena what its workers map (SGLang's weight cache).
    arena_module: str

    def arena_argv(self, slot: SlotSpec) -> list[str]:
        """Extra arena options this backend needs (e.g. a weight-cache socket)."""
        ...

    def worker_argv(self, slot: SlotSpec, spec: WorkerSpec) -> list[str]:
        """The worker's command line after the interpreter (``-m module ...``)."""
        ...

    def worker_env(self, base: dict[str, str]) -> dict[str, str]:
        """The worker's environment, derived from the supervisor's."""
        ...

    async def ready(self, session: aiohttp.ClientSession, url: str, shadow: bool) -> bool:
        """True once a started worker (or shadow) can be routed to (or promoted)."""
        ...

    async def promote(self, session: aiohttp.ClientSession, url: str, timeout: float,
                      predecessor: str | None = None) -> float | None:
        """Turn a fenced slot's shadow into its worker; returns the worker's own seconds
        (None if it does not say). ``predecessor``: the URL of the worker it replaces (whose
        in-flight requests it may adopt). Raises WorkerLost."""
        ...

    def members(self, pid: int) -> dict[int, str]:
        """Processes of the ready worker ``pid``'s group (pid -> title) whose exit fails the
        whole group: its ranks, say. Empty when the leader's exit says it all."""
        ...

    async def reaped(self, session: aiohttp.ClientSession, url: str) -> None:
        """The process group of the worker or shadow at ``url`` is gone (fenced and reaped):
        nothing of it can write shared memory again."""
        ...

    async def healthy(self, session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
        """One cheap liveness probe of a serving worker."""
        ...

    async def flush(self, session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
        """Drop cached KV/prefixes (after a weight update); True when the worker agreed."""
        ...
