"""Real fail-stop faults against a live sandbox (no mocks): the primitives FaultInjection fires.

Each function acts on the env's *current* container at the moment it fires, so a fault
scheduled during an action hits whatever container runs it (including a restored one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from typing import Any, Literal

import docker
import requests

from belayer.errors import SandboxLost

# a fault aimed at a container that is already gone, or a daemon too slow to answer, is a
# fault that did not fire: it must never crash the thread that injects it
_DAEMON_ERRORS = (docker.errors.APIError, requests.exceptions.RequestException)

FaultKind = Literal["kill", "oom", "kill_processes", "break_transport", "checkpoint_fail", "restore_fail"]
ACTION_FAULTS: tuple[FaultKind, ...] = ("kill", "oom", "kill_processes", "break_transport")
CHECKPOINT_PHASES = ("frozen", "runtime_dumped", "layer_captured", "thawed", "written", "published")
RESTORE_PHASES = ("created", "layer_installed", "started", "verified")


class InjectedFault(SandboxLost):
    """Raised inside a checkpoint/restore phase to simulate the process doing it crashing."""


def kill_container(client: docker.DockerClient, container_id: str) -> None:
    """SIGKILL the container through the daemon (a host or runtime crash, seen from the env)."""
    with contextlib.suppress(*_DAEMON_ERRORS):
        client.api.kill(container_id, signal="SIGKILL")


def oom_container(client: docker.DockerClient, container_id: str) -> None:
    """Make the kernel OOM killer take the container's PID 1 (so the container dies).

    PID 1's oom_score_adj goes to 1000, then a dozen processes each take a slice of the
    memory limit: none of them scores as high as PID 1, so the kernel kills PID 1 first.
    """
    hog = ("import time; b = bytearray(48 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(60)")
    script = f"echo 1000 > /proc/1/oom_score_adj; for i in $(seq 64); do python3 -c \"{hog}\" & done; wait"
    with contextlib.suppress(*_DAEMON_ERRORS):
        exec_id = client.api.exec_create(container_id, ["sh", "-c", script])["Id"]
        client.api.exec_start(exec_id, detach=True)


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
