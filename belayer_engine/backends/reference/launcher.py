"""The supervisor's side of the reference worker: its command line and ready/promote/probe.

A shadow answers 503 on ``/health`` by design (it may not serve before it is fenced in),
so its readiness is ``/belayer/state == "shadow"``; promotion is ``POST /belayer/activate``
(the worker takes the live-KV lease from the arena and starts its scheduler).
"""

from __future__ import annotations

import aiohttp

from belayer_core.errors import WorkerLost
from belayer_engine.backends.base import SlotSpec, WorkerSpec
from belayer_engine.common.net import http_status


class ReferenceBackend:
    """The embedded PyTorch worker (``belayer_engine.backends.reference.worker``)."""

    name = "reference"
    isolated_kv = False  # KV blocks live in the arena: promote only after the reap
    arena_module = "belayer_engine.arena"
    template_module = "belayer_engine.backends.reference.worker"
    """Kept imported by the supervisor's ``ForkTemplate``: a new shadow is a clone of it, not
    a fresh interpreter importing torch (the worker module's ``main(argv)`` runs in the clone)."""

    def __init__(self, extra_args: list[str] | None = None) -> None:
        self.extra_args = list(extra_args or [])

    def arena_argv(self, slot: SlotSpec) -> list[str]:
        return []

    def worker_argv(self, slot: SlotSpec, spec: WorkerSpec) -> list[str]:
        argv = ["-m", "belayer_engine.backends.reference.worker", "--arena-socket", str(slot.arena_socket),
                "--host", spec.host, "--port", str(spec.port), "--worker-id", spec.worker_id]
        return argv + (["--shadow"] if spec.shadow else []) + self.extra_args

    def worker_env(self, base: dict[str, str]) -> dict[str, str]:
        return dict(base)

    async def ready(self, session: aiohttp.ClientSession, url: str, shadow: bool) -> bool:
        if shadow:
            status, body = await http_status(session, url + "/belayer/state")
            return status == 200 and body.get("state") == "shadow"
        return (await http_status(session, url + "/health"))[0] == 200

    def members(self, pid: int) -> dict[int, str]:
        return {}  # one process: its exit is the leader's

    async def reaped(self, session: aiohttp.ClientSession, url: str) -> None:
        return None  # the arena's live-KV lease already went with the dead worker's connection

    async def promote(self, session: aiohttp.ClientSession, url: str, timeout: float,
                      predecessor: str | None = None) -> float | None:
        try:
            async with session.post(url + "/belayer/activate", json={},
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise WorkerLost(f"promote failed: {type(exc).__name__}: {exc}") from exc
        if resp.status != 200 or not isinstance(body, dict) or body.get("status") != "active":
            raise WorkerLost(f"promote answered {resp.status}: {body}")
        return body.get("activate_s")

    async def healthy(self, session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
        try:
            return (await http_status(session, url + "/health", timeout))[0] == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def flush(self, session: aiohttp.ClientSession, url: str, timeout: float) -> bool:
        try:
            async with session.post(url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
