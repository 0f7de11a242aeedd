"""A standby sandbox: the newest checkpoint restored ahead of a failure, kept frozen.

After a checkpoint is published, ``Standby.prepare`` restores it on a background thread
into a container of its own (``<sandbox>-standby-<hex>``, labelled and owned like every
sandbox, so ``belayer gc`` reaps it when its owner dies) and pauses it right after the
restore returns. Frozen, it cannot diverge: its state is the checkpoint's boundary plus
at most the few milliseconds its processes ran between CRIU's resume and the pause, a
state the sandbox could have reached idling at that boundary anyway (between steps the
sandbox runs freely).

Rollback is then ``promote``: fence the failed sandbox (killed, name freed), rename the
standby to the sandbox's name, thaw it, verify it runs. No bytes move and CRIU does not
run on the critical path. At most one standby per ``Standby`` (one per env): preparing a
new one discards the old one first. Phases (fault injection): ``standby_frozen`` once
prepared, ``standby_thawed`` between thaw and verify.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import docker

from belayer_core.errors import InfraError, RestoreFailed, SandboxLost
from belayer_env.background import Background
from belayer_env.phases import Phase, PhaseHook, no_hook
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox import fence
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.store.manifest import Checkpoint

PREPARE_WAIT_S = 60.0
"""``promote`` waits this long at most for a standby of that checkpoint still being prepared."""


def standby_name(sandbox: str) -> str:
    return f"{sandbox}-standby-{uuid.uuid4().hex[:8]}"


def meminfo_available() -> int | None:
    """Bytes of memory the kernel says are available (None: unknowable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Standby:
    """At most one frozen, pre-restored copy of a checkpoint, ready to replace its sandbox."""

    def __init__(self, client: docker.DockerClient, phase_hook: PhaseHook | None = None,
                 config: SandboxConfig | None = None):
        self.client = client
        self.config = config
        """The restoring side's settings (``full_restore(config=)``): what a standby may ask for."""
        self.hook = phase_hook or no_hook
        self._lock = threading.Lock()
        self._checkpoint: Checkpoint | None = None
        self._sandbox: DockerSandbox | None = None
        self._name: str | None = None
        self._done = threading.Event()
        self._done.set()
        self._cancel = threading.Event()
        self.error: BaseException | None = None
        self.prepare_s: float | None = None

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self._checkpoint

    def ready(self) -> bool:
        return self._done.is_set() and self._sandbox is not None

    def prepare(self, checkpoint: Checkpoint) -> None:
        """Replace the standby with one of ``checkpoint``, all on a background thread: the
        old one is removed first (at most one exists), then the new one is restored."""
        old = self._take()
        name = standby_name(checkpoint.sandbox)
        with self._lock:
            self._checkpoint, self._name, self._sandbox, self.error = checkpoint, name, None, None
            self._cancel = threading.Event()
            self._done = threading.Event()
            done, cancel = self._done, self._cancel
        threading.Thread(target=self._prepare, args=(checkpoint, name, done, cancel, old), daemon=True,
                         name=f"belayer-standby-{name[-8:]}").start()

    def _prepare(self, ck: Checkpoint, name: str, done: threading.Event, cancel: threading.Event,
                 old: tuple[str | None, threading.Event]) -> None:
        t0 = time.monotonic()
        sandbox = None
        try:
            self._remove(*old)
            if cancel.is_set():
                raise SandboxLost(f"standby {name} was discarded before it was prepared")
            sandbox = full_restore(ck, client=self.client, name=name, config=self.config)
            with translate_errors(f"freeze standby {name}"):
                self.client.api.pause(sandbox.container_id)
            self.hook(Phase.STANDBY_FROZEN)
            if cancel.is_set():
                raise SandboxLost(f"standby {name} was discarded while being prepared")
            with self._lock:
                if self._name == name:
                    self._sandbox, self.prepare_s = sandbox, time.monotonic() - t0
                    sandbox = None
        except BaseException as e:  # noqa: BLE001 - a standby that failed is just not there
            with self._lock:
                if self._name == name:
                    self.error = e
        finally:
            if sandbox is not None:  # failed, or discarded meanwhile: nothing of it stays
                with contextlib.suppress(Exception):
                    fence.fence(self.client, name, background=False)
            done.set()

    def promote(self, checkpoint: Checkpoint, name: str, wait_s: float = PREPARE_WAIT_S) -> DockerSandbox | None:
        """Replace sandbox ``name`` with the standby of ``checkpoint``: fence + thaw + verify.

        Returns the live sandbox, or None when there is no usable standby of exactly this
        checkpoint (the caller restores the usual way; a standby that failed at thaw or
        verify is fenced). The standby is consumed either way.
        """
        with self._lock:
            if self._checkpoint is None or self._checkpoint.id != checkpoint.id:
                return None
            done = self._done
        done.wait(wait_s)
        with self._lock:
            sandbox, standby = self._sandbox, self._name
            self._sandbox, self._checkpoint, self._name = None, None, None
        if sandbox is None or standby is None:
            if standby is not None and not done.is_set():
                self._cancel.set()  # still preparing past the wait: it removes itself
            return None
        api, cid = self.client.api, sandbox.container_id
        # the thaw runs beside the fence: the standby shares nothing with the failed sandbox,
        # and only the rename needs the name the fence frees
        thaw = Background(_unpause, api, cid, f"thaw standby {standby}", name="belayer-standby-thaw")
        try:
            # dead in the kernel's view is enough; Docker's state catches up ~50-150 ms later,
            # and the background removal below waits for it
            fenced = fence.kill(self.client, name, docker_view=False)
            with translate_errors(f"promote standby {standby}"):
                api.rename(cid, name)
            thaw.result()
            self.hook(Phase.STANDBY_THAWED)
            promoted = DockerSandbox.attach(cid, checkpoint.config, name, self.client)
            promoted.check_alive(f"thawed standby of {checkpoint.id}")
        except BaseException:
            thaw.join()
            with contextlib.suppress(Exception):  # under either name: nothing half-promoted runs
                fence.fence(self.client, standby, background=False)
                fence.fence(self.client, name, background=False)
            raise
        fence.remove_in_background(self.client, fenced)
        promoted.restored_from = checkpoint.id
        # its processes ran only after this stamp: the next capture can be incremental
        promoted.layer_installed_ns = sandbox.layer_installed_ns
        return promoted

    def discard(self, *, background: bool = False) -> None:
        """Remove the standby (one being prepared is stopped and removes itself);
        ``background``: on a thread, so the caller (a step) does not wait for Docker."""
        old = self._take()
        if background:
            threading.Thread(target=self._remove, args=old, daemon=True, name="belayer-standby-discard").start()
        else:
            self._remove(*old)

    def _take(self) -> tuple[str | None, threading.Event]:
        """Forget the current standby; return what removing it needs (its name, its thread's end)."""
        with self._lock:
            name, done = self._name, self._done
            self._sandbox, self._checkpoint, self._name = None, None, None
            self._cancel.set()
        return name, done

    def _remove(self, name: str | None, done: threading.Event) -> None:
        done.wait(PREPARE_WAIT_S)  # a preparation still running stops at its next check
        if name is not None:
            with contextlib.suppress(Exception):
                fence.fence(self.client, name, background=False)


def _unpause(api: docker.APIClient, container_id: str, what: str) -> None:
    with translate_errors(what):
        api.unpause(container_id)


def promote_or_none(standby: Standby | None, checkpoint: Checkpoint, name: str) -> DockerSandbox | None:
    """``standby.promote`` where a failed promotion is one more reason to restore the usual way."""
    if standby is None:
        return None
    try:
        return standby.promote(checkpoint, name)
    except (InfraError, RestoreFailed):
        return None
