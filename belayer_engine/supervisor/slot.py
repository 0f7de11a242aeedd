"""What a slot is made of and how its processes are started, promoted and probed.

No recovery decisions here (they live in ``supervisor.py``), and nothing about one kind of
worker: the arena's command line is ours, a worker's comes from its ``WorkerBackend``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from belayer_core.errors import BelayerError, WorkerLost
from belayer_engine.arena.client import ArenaClient
from belayer_engine.backends.base import SlotSpec, WorkerBackend, WorkerSpec
from belayer_engine.common import owner, worker_auth
from belayer_engine.common.net import free_port
from belayer_engine.common.routing import Endpoint
from belayer_engine.supervisor.config import SupervisorConfig
from belayer_engine.supervisor.fork_template import ForkTemplate
from belayer_engine.supervisor.processes import Proc, fence, spawn, wait_until

log = logging.getLogger(__name__)


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
    promoted_at: float | None = None
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

    def __init__(self, config: SupervisorConfig, backend: WorkerBackend, run_dir: Path,
                 session: aiohttp.ClientSession, worker_secret: str | None = None) -> None:
        self.config = config
        self.backend = backend
        self.run_dir = run_dir
        self.session = session
        self._seq = itertools.count(1)
        self._env = {**_child_env(), **owner.env_for_children()}  # children watch this process
        self._env.pop(worker_auth.ENV, None)
        # Workers and shadows get the secret in their environment (never argv); the arena does not.
        self._worker_env = {**self._env, worker_auth.ENV: worker_secret} if worker_secret else self._env
        self.template: ForkTemplate | None = None  # set once the supervisor has started one

    def new_template(self) -> ForkTemplate | None:
        """A template of the backend's worker program (``template_module``), not started; None
        when the backend has none. It gets the workers' environment without the secret
        (each clone gets its own, secret included, with its request)."""
        module = getattr(self.backend, "template_module", None)
        if not module:
            return None
        return ForkTemplate(self.config.python, module, self.backend.worker_env(self._env),
                            self.run_dir / "worker-template.log")

    def spec(self, slot: Slot) -> SlotSpec:
        return SlotSpec(name=slot.name, device=slot.device, arena_socket=slot.socket, run_dir=self.run_dir)

    async def start_arena(self, slot: Slot) -> Proc:
        cfg = self.config
        slot.socket.unlink(missing_ok=True)
        argv = [cfg.python, "-m", self.backend.arena_module, "--socket", str(slot.socket), "--device", slot.device]
        if cfg.model:
            argv += ["--model-dir", cfg.model]
        argv += self.backend.arena_argv(self.spec(slot)) + cfg.arena_args
        proc = await spawn("arena", f"arena-{slot.name}", argv, self.run_dir / f"arena-{slot.name}.log", env=self._env)

        async def ready() -> bool:  # the arena binds its socket only once weights and KV exist
            return slot.socket.exists()

        await self._ready_or_fence(proc, ready, "ready (arena socket)")
        return proc

    async def start_worker(self, slot: Slot, shadow: bool) -> Proc:
        cfg = self.config
        role = "shadow" if shadow else "worker"
        spec = WorkerSpec(worker_id=f"{slot.name}-{role}-{next(self._seq)}", host=cfg.host,
                          port=free_port(cfg.host), shadow=shadow)
        argv = [cfg.python, *self.backend.worker_argv(self.spec(slot), spec)]
        url = f"http://{cfg.host}:{spec.port}"
        log_path, env = self.run_dir / f"{spec.worker_id}.log", self.backend.worker_env(self._worker_env)
        proc = None
        if self.template is not None and self.template.alive:  # a clone: no interpreter start, no imports
            with contextlib.suppress(WorkerLost):
                proc = await self.template.spawn(role, spec.worker_id, argv, log_path, url=url, env=env)
        if proc is None:
            proc = await spawn(role, spec.worker_id, argv, log_path, url=url, env=env)

        async def ready() -> bool:
            return await self.backend.ready(self.session, url, shadow)

        await self._ready_or_fence(proc, ready, "ready")
        return proc

    async def _ready_or_fence(self, proc: Proc, ready, what: str) -> None:
        try:
            await wait_until(ready, proc, self.config.start_timeout_s, what)
        except BaseException:
            with contextlib.suppress(WorkerLost):
                await fence(proc, self.config.fence_timeout_s)
            raise

    async def promote(self, shadow: Proc, predecessor: Proc | None = None) -> float | None:
        """Make ``shadow`` the slot's worker (only after the old worker, ``predecessor``, is
        fenced); raises WorkerLost."""
        assert shadow.url is not None
        return await self.backend.promote(self.session, shadow.url, self.config.start_timeout_s,
                                          predecessor=predecessor.url if predecessor is not None else None)

    def members(self, proc: Proc) -> dict[int, str]:
        """The processes of ``proc``'s group whose exit is the group's failure (pid -> title)."""
        try:
            return self.backend.members(proc.pid)
        except OSError:
            return {}

    async def reaped(self, proc: Proc) -> None:
        """Tell the backend that ``proc``'s process group is gone (logged, never raised)."""
        if proc.url is None:
            return
        try:
            await self.backend.reaped(self.session, proc.url)
        except Exception as exc:  # the arena is checked on its own; this is bookkeeping
            log.warning("%s: the backend's reap notice failed: %s", proc.name, exc)

    async def healthy(self, proc: Proc) -> bool:
        """One cheap liveness probe."""
        assert proc.url is not None
        return await self.backend.healthy(self.session, proc.url, self.config.health_timeout_s)

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
