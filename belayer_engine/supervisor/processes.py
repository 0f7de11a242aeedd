"""Child processes for the supervisor: spawn in their own process group, wait, fence.

Every arena, worker and shadow runs in a new session (its own process group), so fencing
kills everything the worker started and nothing else. Fencing is SIGKILL to the group,
then waiting until the child is reaped and the group is empty: only then may a shadow
touch the KV arena the old worker was writing. A child may also be a clone of a
``fork_template.ForkTemplate``; it is waited for and fenced the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp

from belayer_core.errors import WorkerLost

log = logging.getLogger("belayer_engine.start")
PROGRESS_EVERY_S = 15.0
"""A start still waiting says so this often (a first SGLang start compiles kernels for minutes)."""


class ProcessHandle(Protocol):
    """What the supervisor uses of a child: ``asyncio.subprocess.Process``, or a clone's
    ``fork_template.ClonedProcess``."""

    pid: int
    returncode: int | None

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...


@dataclass(eq=False)
class Proc:
    """One child process and what the supervisor knows about it."""

    role: str  # "arena" | "worker" | "shadow"
    name: str
    process: ProcessHandle
    log_path: Path
    url: str | None = None
    started: float = field(default_factory=time.monotonic)
    fenced: bool = False
    cloned: bool = False  # started by a ForkTemplate

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""


async def spawn(role: str, name: str, argv: list[str], log_path: Path, url: str | None = None, env: dict | None = None) -> Proc:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True, env=env,
        )
    return Proc(role=role, name=name, process=process, log_path=log_path, url=url)


def kill_group(proc: Proc) -> None:
    """SIGKILL the process group: from here on none of its processes runs user code again
    (the kernel may still be tearing them down, e.g. releasing a CUDA context)."""
    proc.fenced = True
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: pgid == pid


async def fence(proc: Proc, timeout: float) -> float:
    """SIGKILL the process group and wait until reaped and empty; returns seconds taken."""
    t0 = time.monotonic()
    kill_group(proc)
    pgid = proc.pid
    try:
        await asyncio.wait_for(proc.process.wait(), timeout)
    except TimeoutError:
        raise WorkerLost(f"{proc.name} (pid {proc.pid}) not reaped {timeout:.1f}s after SIGKILL") from None
    deadline = time.monotonic() + timeout
    while True:  # grandchildren of the group may outlive the leader by a moment
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise WorkerLost(f"process group {pgid} of {proc.name} still alive after SIGKILL")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def stop_gracefully(proc: Proc, timeout: float) -> None:
    """SIGTERM (the arena removes its shared-memory files), then fence whatever is left."""
    if proc.alive:
        with contextlib.suppress(ProcessLookupError):
            proc.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.process.wait(), timeout)
    await fence(proc, timeout)


async def wait_until(
    check: Callable[[], Awaitable[bool]], proc: Proc, timeout: float, what: str, interval: float = 0.05,
    progress_every: float = PROGRESS_EVERY_S,
) -> None:
    """Poll ``check`` until true; fail fast with the log tail if ``proc`` dies first. A wait
    longer than ``progress_every`` logs a line (warning: shown without logging set up) every
    ``progress_every`` seconds, with the child's newest log line, instead of waiting silently."""
    start = time.monotonic()
    deadline, report_at = start + timeout, start + progress_every
    while True:
        if not proc.alive:
            raise WorkerLost(f"{proc.name} exited ({proc.process.returncode}) before {what}:\n{proc.log_tail()}")
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
            if await check():
                return
        now = time.monotonic()
        if now > deadline:
            raise WorkerLost(f"{proc.name} not {what} after {timeout:.0f}s:\n{proc.log_tail()}")
        if now >= report_at:
            report_at = now + progress_every
            last = (proc.log_tail(400).strip().splitlines() or ["(no output yet)"])[-1]
            log.warning("%s not %s yet: %.0f s of %.0f s; its log says: %s", proc.name, what, now - start,
                        timeout, last[-200:])
        await asyncio.sleep(interval)
