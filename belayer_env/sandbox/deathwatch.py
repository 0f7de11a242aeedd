"""``DeathWatch``: learn that a sandbox's init died the moment it dies, not at the next exec.

The env arms it while the agent holds the turn (the LLM generates the next action): a
container killed then is restored in the background instead of being found dead by the
next step (``EnvConfig.recover_while_idle``). The kernel says when a process exits through
a pidfd (Linux >= 5.3), so the watch costs a thread blocked in ``poll``, no polling of the
daemon. Where the init's pid is not visible (a remote Docker host, another pid namespace)
the watch reports itself unavailable and the env keeps finding deaths at the next step.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable
from typing import Any

DeathCallback = Callable[[int], None]
"""Called with the arming's generation on the watch's thread when the watched init dies."""


def init_pid(client: Any, container_id: str) -> int | None:
    """The container's init pid as the host sees it; None when the container is not running."""
    state = client.api.inspect_container(container_id)["State"]
    pid = state.get("Pid") or 0
    return pid if state.get("Running") and pid > 0 else None


def _in_container(pid: int, container_id: str) -> bool:
    """``pid`` is a process of ``container_id`` (its cgroup path names the container): the
    pid is this host's and was not reused by an unrelated process."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return container_id in f.read()
    except OSError:
        return False


class DeathWatch:
    """One armed watch at a time: ``arm`` (re)points it at a container, ``disarm`` stops it.

    Each arming gets a generation number; the callback receives it so the caller can
    ignore a death reported for an arming it has since replaced. ``available`` turns False
    for good when this host cannot see the container's processes.
    """

    def __init__(self, client: Any, on_death: DeathCallback):
        self.client = client
        self.on_death = on_death
        self.available = hasattr(os, "pidfd_open")
        self.generation = 0
        self._lock = threading.Lock()
        self._stop: tuple[int, int] | None = None  # the current arming's wake-up pipe

    def arm(self, container_id: str) -> int:
        """Watch ``container_id``'s init from now on (on a thread: nothing here blocks)."""
        with self._lock:
            self._disarm_locked()
            self.generation += 1
            if not self.available:
                return self.generation
            stop = os.pipe()
            self._stop = stop
            generation = self.generation
        threading.Thread(target=self._watch, args=(container_id, generation, stop), daemon=True,
                         name=f"belayer-deathwatch-{container_id[:12]}").start()
        return generation

    def disarm(self) -> None:
        with self._lock:
            self._disarm_locked()
            self.generation += 1  # a death already being reported is now stale

    def _disarm_locked(self) -> None:
        """Wake the arming's thread; the write end is ours to close (the thread closes the
        read end), so no write ever lands on a descriptor number reused meanwhile."""
        if self._stop is not None:
            with contextlib.suppress(OSError):  # the thread is gone: EPIPE
                os.write(self._stop[1], b"x")
            os.close(self._stop[1])
            self._stop = None

    def _watch(self, container_id: str, generation: int, stop: tuple[int, int]) -> None:
        read_end = stop[0]
        pidfd = -1
        try:
            try:
                pid = init_pid(self.client, container_id)
            except Exception:  # noqa: BLE001 - the daemon cannot say: the next step will find out
                return
            if pid is None:
                self._report(generation)  # dead before the watch began
                return
            try:
                pidfd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._report(generation)  # exited between the inspect and now
                return
            except OSError:  # no pidfds here (old kernel, seccomp): watch nothing, for good
                self.available = False
                return
            if not _in_container(pid, container_id):
                with contextlib.suppress(Exception):
                    if init_pid(self.client, container_id) is None:
                        self._report(generation)  # gone already (its pid maybe reused)
                        return
                self.available = False  # alive, but its pid is not this host's: another pid namespace
                return
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.register(read_end, select.POLLIN)
            ready = {fd for fd, _ in poller.poll()}
            if pidfd in ready and read_end not in ready:
                self._report(generation)
        finally:
            for fd in (pidfd, read_end):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _report(self, generation: int) -> None:
        with self._lock:
            current = generation == self.generation
        if current:
            self.on_death(generation)
