"""What a slot is made of and how its processes are started, activated and probed.

No recovery decisions here (they live in ``supervisor.py``): this module only knows the
command lines of arena and worker, and what "ready" means for each of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from belayer.errors import BelayerError, WorkerLost

from .arena_client import ArenaClient
from .router.table import Endpoint
from .supervisor_config import SupervisorConfig
from .supervisor_procs import Proc, fence, free_port, http_status, spawn, wait_until


@dataclass(eq=False)
class Slot:
    """One device: its arena, the serving worker and the shadow waiting to replace it."""

    name: str
    index: int
    device: str
    socket: Path
    arena: Proc | None = None
    worker: Proc | None = None
    endpoint: Endpoint | None = None
    shadow: Proc | None = None
    arming: asyncio.Task | None = None
    activated_at: float | None = None
    excluded: bool = False
    handovers: int = 0
    cold_starts: int = 0
    probe_failures: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _child_env() -> dict[str, str]:
    """Children import this very checkout, even when it is not installed."""
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class SlotProcesses:
    """Starts arena / worker / shadow processes of slots and talks to them."""

    def __init__(self, config: SupervisorConfig, run_dir: Path, session: aiohttp.ClientSession) -> None:
        self.config = config
        self.run_dir = run_dir
        self.session = session
        self._seq = itertools.count(1)
        self._env = _child_env()

    async def start_arena(self, slot: Slot) -> Proc:
        cfg = self.config
        slot.socket.unlink(missing_ok=True)
        argv = [cfg.python, "-m", "belayer_engine.arena", "--socket", str(slot.socket), "--device", slot.device]
        if cfg.model:
            argv += ["--model-dir", cfg.model]
        proc = await spawn("arena", f"arena-{slot.name}", argv + cfg.arena_args, self.run_dir / f"arena-{slot.name}.log", env=self._env)

        async def ready() -> bool:  # the arena binds its socket only once weights and KV exist
            return slot.socket.exists()

        await self._ready_or_fence(proc, ready, "ready (arena socket)")
        return proc

    async def start_worker(self, slot: Slot, shadow: bool) -> Proc:
        cfg = self.config
        port = free_port(cfg.host)
        role = "shadow" if shadow else "worker"
        wid = f"{slot.name}-{role}-{next(self._seq)}"
        argv = [cfg.python, "-m", "belayer_engine.worker", "--arena-socket", str(slot.socket), "--host", cfg.host,
                "--port", str(port), "--worker-id", wid] + (["--shadow"] if shadow else []) + cfg.worker_args
        url = f"http://{cfg.host}:{port}"
        proc = await spawn(role, wid, argv, self.run_dir / f"{wid}.log", url=url, env=self._env)
        session = self.session

        async def ready() -> bool:
            if shadow:  # a shadow answers 503 on /health by design
                status, body = await http_status(session, url + "/belayer/state")
                return status == 200 and body.get("state") == "shadow"
            return (await http_status(session, url + "/health"))[0] == 200

        await self._ready_or_fence(proc, ready, "ready")
        return proc

    async def _ready_or_fence(self, proc: Proc, ready, what: str) -> None:
        try:
            await wait_until(ready, proc, self.config.start_timeout_s, what)
        except BaseException:
            with contextlib.suppress(WorkerLost):
                await fence(proc, self.config.fence_timeout_s)
            raise

    async def activate(self, shadow: Proc) -> float | None:
        """``POST /belayer/activate`` (only after the old worker is fenced); raises WorkerLost."""
        timeout = aiohttp.ClientTimeout(total=self.config.start_timeout_s)
        try:
            async with self.session.post(shadow.url + "/belayer/activate", json={}, timeout=timeout) as resp:
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise WorkerLost(f"activate failed: {type(exc).__name__}: {exc}") from exc
        if resp.status != 200 or not isinstance(body, dict) or body.get("status") != "active":
            raise WorkerLost(f"activate answered {resp.status}: {body}")
        return body.get("activate_s")

    async def healthy(self, proc: Proc) -> bool:
        """One cheap ``GET /health`` probe."""
        try:
            return (await http_status(self.session, proc.url + "/health", self.config.health_timeout_s))[0] == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def arena_health(self, slot: Slot) -> dict | None:
        """The arena's own health answer, or None when the owner is gone or silent."""
        if slot.arena is None or not slot.arena.alive or not slot.socket.exists():
            return None
        client = ArenaClient(str(slot.socket), timeout=self.config.health_timeout_s)
        try:
            return await asyncio.to_thread(client.health)
        except BelayerError:
            return None


def started_for(proc: Proc) -> float:
    return time.monotonic() - proc.started
