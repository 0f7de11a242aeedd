"""Real fail-stop faults against a live env's sandbox (no mocks): the one mechanism.

``FaultInjector`` fires them into a ``RecoverableSandboxEnv``: now, after a delay (on a
timer thread), or armed at a named ``Phase`` of the next capture / restore (through the
env's ``add_phase_hook``). The consistency harness plans faults with it and the
Gymnasium wrapper ``wrappers.fault_injection.FaultInjection`` is a thin layer over it.
A fault acts on the env's *current* container at the moment it fires, so a fault
scheduled during an action hits whatever container runs it (including a restored one).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import docker
import requests

from belayer_core.errors import InfraError, SandboxLost
from belayer_env.common.phases import Operation, Phase
from belayer_env.sandbox.fence import sandbox_containers
from belayer_env.sandbox.freezer import CGROUP_ROOT

if TYPE_CHECKING:
    from belayer_env.env.recoverable import RecoverableSandboxEnv

# a fault aimed at a container that is already gone, or a daemon too slow to answer, is a
# fault that did not fire: it must never crash the thread that injects it
_DAEMON_ERRORS = (docker.errors.APIError, requests.exceptions.RequestException)

FaultKind = Literal["kill", "oom", "kill_processes", "break_transport", "checkpoint_fail", "restore_fail"]
ActionFault = Literal["kill", "oom", "kill_processes", "break_transport"]
ACTION_FAULTS: tuple[ActionFault, ...] = ("kill", "oom", "kill_processes", "break_transport")
How = Literal["kill", "raise"]
"""How an armed phase fails: the sandbox's containers are killed, or the phase raises."""


class InjectedFault(SandboxLost):
    """Raised inside a checkpoint/restore phase to simulate the process doing it crashing."""


def kill_container(client: docker.DockerClient, container_id: str) -> None:
    """SIGKILL the container through the daemon (a host or runtime crash, seen from the env)."""
    with contextlib.suppress(*_DAEMON_ERRORS):
        client.api.kill(container_id, signal="SIGKILL")


def oom_container(client: docker.DockerClient, container_id: str) -> None:
    """Make the kernel OOM killer take the container's PID 1 (so the container dies).

    PID 1's oom_score_adj goes to 1000, then memory is taken in the container's memory
    cgroup until the limit is hit: from the host where the daemon is local (``oom_hog``: a
    process in the container's memory and freezer cgroups, no exec, so a capture racing the
    fault is not refused), else by a ``docker exec``. Either way in 32 MiB children, one
    after another (``oom_hog`` says why each must stay small).
    """
    with contextlib.suppress(*_DAEMON_ERRORS):
        init = client.api.inspect_container(container_id)["State"].get("Pid") or 0
        if init > 0 and _oom_from_host(init, container_id):
            return
        exec_id = client.api.exec_create(container_id, ["sh", "-c", _OOM_EXEC])["Id"]
        client.api.exec_start(exec_id, detach=True)


_OOM_HOG = Path(__file__).with_name("oom_hog.py")
OOM_HANDSHAKE_S = 5.0
"""How long ``oom_container`` waits to hear that the hog joined the sandbox's cgroups."""
_OOM_EXEC = ("echo 1000 > /proc/1/oom_score_adj && exec python3 -c \"import os, time\n"
             "while True:\n"
             "    r, w = os.pipe()\n"
             "    if os.fork() == 0:\n"
             "        held = bytearray(b'x') * (32 << 20)\n"
             "        os.write(w, b'.')\n"
             "        time.sleep(600)\n"
             "        os._exit(0)\n"
             "    os.close(w)\n"
             "    os.read(r, 1)\n"  # one child at a time: no more forks than the limit needs
             "    os.close(r)\n\"")


def _oom_from_host(init: int, container_id: str) -> bool:
    """Start ``oom_hog`` against the container whose init is pid ``init``; False where that
    is not possible here (a remote daemon, no privilege, a cgroup layout it cannot join)."""
    procs = _sandbox_cgroups(init, container_id)
    if procs is None:
        return False
    try:
        Path(f"/proc/{init}/oom_score_adj").write_text("1000")
    except OSError:
        return False
    hog = subprocess.Popen([sys.executable, "-I", "-S", str(_OOM_HOG), str(init), *map(str, procs)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    threading.Thread(target=hog.wait, daemon=True, name="belayer-oom-hog-reaper").start()
    assert hog.stdout is not None
    with hog.stdout:
        # a child joining a frozen sandbox waits for the thaw: past this, it is under way
        if not select.select([hog.stdout], [], [], OOM_HANDSHAKE_S)[0]:
            return True
        told = hog.stdout.readline()
    return not told.startswith(b"failed")


def _sandbox_cgroups(init: int, container_id: str) -> list[Path] | None:
    """The ``cgroup.procs`` files the hog joins: cgroup v1's memory and freezer controllers,
    or v2's one cgroup; None unless they are this container's own, here."""
    try:
        lines = [line.split(":", 2) for line in Path(f"/proc/{init}/cgroup").read_text().splitlines()]
    except OSError:
        return None
    if (CGROUP_ROOT / "cgroup.controllers").exists():  # v2 only: memory and freezer in one
        wanted = [(CGROUP_ROOT, next((path for _n, names, path in lines if names == ""), None))]
    else:
        wanted = [(CGROUP_ROOT / c, next((path for _n, names, path in lines if c in names.split(",")), None))
                  for c in ("memory", "freezer")]  # memory first: a frozen sandbox freezes the joiner
    procs = []
    for root, path in wanted:
        # the container's own cgroup: a pid from a remote daemon may name any local process
        if path is None or container_id not in path:
            return None
        procs.append(root / path.lstrip("/") / "cgroup.procs")
        if not procs[-1].exists():
            return None
    return procs


def kill_processes(client: docker.DockerClient, container_id: str) -> None:
    """SIGKILL every process of the container from the host, PID 1 included (kernel-level)."""
    with contextlib.suppress(*_DAEMON_ERRORS):
        init = client.api.inspect_container(container_id)["State"].get("Pid") or 0
        top = client.api.top(container_id, ps_args="-eo pid")
        pids = [init] + [int(row[0]) for row in top.get("Processes") or [] if row and row[0].isdigit()]
        for pid in pids:  # init first: whatever dies next, the container is already dead
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                if pid > 0:
                    os.kill(pid, signal.SIGKILL)


class TransportBreaker:
    """Records the exec sockets a Docker client opens, so they can be cut mid-stream.

    Wraps ``client.api.exec_start`` on that one client instance (what a network blip or a
    daemon-side proxy crash does to the stream); the command keeps running in the
    container, which is exactly why the env must fence it.
    """

    def __init__(self, client: docker.DockerClient):
        self.api = client.api
        self._sockets: list[Any] = []
        original = self.api.exec_start

        def exec_start(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            if kwargs.get("socket"):
                self._sockets = [s for s in self._sockets if _fileno(s) >= 0][-8:] + [result]
                if self._cut_next:
                    self._cut_next = False
                    self.break_all()
            return result

        self._cut_next = False
        self.api.exec_start = exec_start

    def cut_next(self) -> None:
        """Cut the next exec's stream right after it starts (the command still runs)."""
        self._cut_next = True

    def break_all(self) -> None:
        for s in self._sockets:
            raw = getattr(s, "_sock", s)
            with contextlib.suppress(OSError, AttributeError):
                raw.shutdown(socket.SHUT_RDWR)
        self._sockets = []


def _fileno(s: Any) -> int:
    try:
        return getattr(s, "_sock", s).fileno()
    except (OSError, AttributeError):
        return -1


class FaultInjector:
    """Fires real faults into ``env``; ``injected`` lists what fired (a dict per fault).

    ``context`` (optional) adds fields to every record (e.g. the wrapper's step count).
    """

    def __init__(self, env: RecoverableSandboxEnv, context: dict[str, Any] | None = None):
        self.env = env
        self.context = context if context is not None else {}
        self.injected: list[dict[str, Any]] = []
        self._breaker = TransportBreaker(env.client)
        self._timers: list[threading.Timer] = []
        self._armed: dict[Operation, tuple[Phase, How]] = {}
        self._remove_hook = env.add_phase_hook(self._on_phase)

    def fire(self, kind: ActionFault, delay_s: float = 0.0) -> None:
        """Fire ``kind`` at the env's current container now, or ``delay_s`` later on a timer."""
        if delay_s <= 0:
            self._fire_now(kind)
            return
        timer = threading.Timer(delay_s, self._fire_now, args=(kind,))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def arm(self, operation: Operation, phase: Phase | str, how: How = "kill") -> None:
        """Fail the next ``operation`` ("checkpoint" or "restore") when it reaches ``phase``."""
        self._armed[operation] = (Phase(phase), how)

    def disarm(self) -> None:
        self._armed.clear()

    def cancel(self) -> None:
        """Cancel the timers not yet fired and wait (bounded) for any firing now."""
        for t in self._timers:
            t.cancel()
            t.join(timeout=5)
        self._timers = []

    def close(self) -> None:
        self.cancel()
        self.disarm()
        self._remove_hook()

    def _fire_now(self, kind: ActionFault) -> None:
        sandbox = self.env.sandbox
        if sandbox is None:
            return
        client, cid = self.env.client, sandbox.container_id
        self.injected.append({"kind": kind, **self.context, "container": cid[:12], "time": time.time()})
        if kind == "kill":
            kill_container(client, cid)
        elif kind == "oom":
            oom_container(client, cid)
        elif kind == "kill_processes":
            kill_processes(client, cid)
        elif kind == "break_transport":
            self._breaker.break_all()

    def _on_phase(self, phase: Phase) -> None:
        op = phase.operation
        armed = self._armed.get(op)
        if armed is None or armed[0] != phase:
            return
        del self._armed[op]
        how = armed[1]
        self.injected.append({"kind": f"{op}_fail", "phase": str(phase), "how": how, **self.context,
                              "time": time.time()})
        if how == "raise":
            raise InjectedFault(f"injected fail-stop during {op} at phase '{phase}'")
        with contextlib.suppress(*_DAEMON_ERRORS, InfraError):
            for c in sandbox_containers(self.env.client, self.env.name, by_name=True):  # a promoted standby too
                kill_container(self.env.client, c["Id"])
