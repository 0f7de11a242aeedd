"""``WarmForks``: forks of one checkpoint restored ahead and kept frozen; a fork is a thaw.

``warm_forks(ck, n)`` (``forks/fork.py``) starts one: on a thread (while the agent's LLM
generates), ``fork(ck, n)`` runs as usual (shared layer, verified images, every fork a
restore under a new name) and each fork's cgroup is frozen right after (the standby's way,
``restore/standby.py``: Docker never pauses it, and Docker's view, running with its init,
is checked then). ``fork(ck, k, warm=warm)`` with k <= n then takes k of them: thaw each
cgroup, check its init is alive, hand them out; nothing is restored, fenced or renamed on
the call. Frozen, a warm fork cannot diverge: its state is the checkpoint's boundary plus
the few milliseconds its processes ran between CRIU's resume and the freeze, as for any
fork that then idles.

All or none: a fork that does not thaw or verify fences every fork taken, and the call
falls back to restoring (``take`` returns None). A fork of any other checkpoint never
uses them. Each warm fork is a sandbox from its restore (labelled, owned: ``belayer gc``
reaps it if this process dies); ``close`` fences the ones not taken. The price: the
checkpoint's memory and a running container per warm fork, held until taken or closed,
and one fork of background CPU per prepared checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import docker

from belayer_core.errors import SandboxLost
from belayer_env.restore.standby import freeze_checked
from belayer_env.sandbox import fence, freezer
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.store.manifest import Checkpoint


class WarmForks:
    """Up to ``n`` forks of ``checkpoint``, restored and frozen on a thread (``make(n)``: the forks)."""

    def __init__(self, checkpoint: Checkpoint, n: int, client: docker.DockerClient,
                 make: Callable[[int], list[DockerSandbox]], config: SandboxConfig | None = None):
        self.checkpoint, self.client, self.config = checkpoint, client, config
        self._lock = threading.Lock()
        self._forks: list[tuple[DockerSandbox, int]] = []
        self._closed = False
        self.error: BaseException | None = None
        self.prepare_s: float | None = None
        self.last_take: dict[str, float] = {}
        """The newest ``take``'s phases in seconds: ``thaw_s`` (every fork), ``verify_s``."""
        self.done = threading.Event()
        threading.Thread(target=self._prepare, args=(n, make), daemon=True, name="belayer-warm-forks").start()

    def _prepare(self, n: int, make: Callable[[int], list[DockerSandbox]]) -> None:
        t0 = time.monotonic()
        made: list[DockerSandbox] = []
        try:
            made = make(n)
            frozen = [(f, _freeze(self.client, f)) for f in made]
            with self._lock:
                if not self._closed:
                    self._forks, made = frozen, []
                    self.prepare_s = time.monotonic() - t0
        except BaseException as e:  # noqa: BLE001 - warm forks that failed are just not there
            self.error = e
        finally:
            for f in made:  # failed, or closed meanwhile
                with contextlib.suppress(Exception):
                    fence.fence(self.client, f.name, background=False)
            self.done.set()

    def ready(self) -> bool:
        return self.done.is_set() and bool(self._forks)

    def take(self, checkpoint: Checkpoint, n: int, wait_s: float = 0.0) -> list[DockerSandbox] | None:
        """``n`` forks of ``checkpoint``, thawed and checked; None (the caller forks the usual
        way) when fewer are ready (``wait_s``: how long to wait for a preparation still running)
        or one fails its thaw or check (every one taken is fenced then)."""
        if checkpoint.id != self.checkpoint.id:
            return None
        self.done.wait(wait_s)
        with self._lock:
            if len(self._forks) < n:
                return None
            taken, self._forks = self._forks[:n], self._forks[n:]
        t0 = time.perf_counter()
        try:
            for f, _ in taken:
                if not freezer.thaw(f.container_id):
                    raise SandboxLost(f"warm fork {f.name} could not be thawed")
            t1 = time.perf_counter()
            for f, pid in taken:
                if not freezer.init_alive(f.container_id, pid):
                    raise SandboxLost(f"warm fork {f.name} lost its init process")
        except SandboxLost:
            for f, _ in taken:
                with contextlib.suppress(Exception):
                    fence.fence(self.client, f.name, background=False)
            return None
        self.last_take = {"thaw_s": t1 - t0, "verify_s": time.perf_counter() - t1}
        return [f for f, _ in taken]

    def close(self) -> None:
        """Fence every warm fork not taken (one still being prepared fences its own)."""
        with self._lock:
            self._closed, left, self._forks = True, self._forks, []
        for f, _ in left:
            with contextlib.suppress(Exception):
                fence.fence(self.client, f.name, background=False)


def _freeze(client: docker.DockerClient, sandbox: DockerSandbox) -> int:
    """Freeze a fork through its cgroup and check it (``standby.freeze_checked``); returns
    the init's pid."""
    cid = sandbox.container_id
    if freezer.control_file(cid) is None:
        raise SandboxLost(f"warm fork {sandbox.name} cannot be frozen through its cgroup here")
    return freeze_checked(client, cid, f"warm fork {sandbox.name}")
