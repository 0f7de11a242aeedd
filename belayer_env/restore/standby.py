"""A standby sandbox: the newest checkpoint restored ahead of a failure, kept frozen.

After a checkpoint is published, ``Standby.prepare`` restores it on a background thread
into a container of its own (``<sandbox>-standby-<hex>``, labelled and owned like every
sandbox, so ``belayer gc`` reaps it when its owner dies) and freezes its cgroup right after
the restore returns. Frozen, it cannot diverge: its state is the checkpoint's boundary plus
at most the few milliseconds its processes ran between CRIU's resume and the freeze, a
state the sandbox could have reached idling at that boundary anyway (between steps the
sandbox runs freely). What a rollback would otherwise check, Docker's view (running, its
init's pid) and the freezer's control file, is checked and kept while preparing.

Rollback is then ``promote``, on its critical path only the kernel and one listing:

- *fence*: list the sandbox's containers (one Docker call) and SIGKILL each one's init
  through the kernel, dead once its cgroup is empty (``freezer.kill_cgroup``);
- *thaw*: write THAWED to the standby's freezer cgroup;
- *verify*: the cgroup thawed and the init Docker reported running alive in it.

Docker's names follow on a thread (``naming.settle_later``): the dead containers renamed
aside, the standby renamed to the sandbox's name; every later fence or restore of that
name waits for them, and a standby that cannot take the name is fenced (its next command
then fails as a lost sandbox: never an observation). The frozen container is one Docker
reports running (it never paused it), so no Docker call is needed to thaw it. Where its
cgroup is not readable here (a remote daemon), Docker pauses and unpauses it instead.

No bytes move and CRIU does not run on the critical path. At most one standby per
``Standby`` (one per env): preparing a new one discards the old one first. Phases (fault
injection): ``standby_frozen`` once prepared, ``standby_thawed`` between thaw and verify.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid

import docker

from belayer_core.errors import InfraError, RestoreFailed, SandboxLost
from belayer_env.common.phases import Phase, PhaseHook, no_hook
from belayer_env.restore.promotion import Frozen, promote_docker, promote_kernel
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox import fence, freezer, naming
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.roster import Roster
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
        self._frozen: Frozen | None = None
        self.error: BaseException | None = None
        self.prepare_s: float | None = None
        naming.start_worker()  # the promotion's renames queue to it, no thread started on a rollback
        self.last_promote: dict[str, float] = {}
        """The newest promotion's phases in seconds: ``fence_s``, ``thaw_s``, ``verify_s``
        (the critical path) and, once set on its thread, ``names_s`` (Docker's renames)."""

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
            frozen = _freeze(self.client, sandbox.container_id, name)
            if frozen is not None:  # the fence of a rollback, listed now
                frozen = dataclasses.replace(frozen, roster=Roster.take(self.client, ck.sandbox,
                                                                        frozen.control.parent.parent))
            self.hook(Phase.STANDBY_FROZEN)
            if cancel.is_set():
                raise SandboxLost(f"standby {name} was discarded while being prepared")
            with self._lock:
                if self._name == name:
                    self._sandbox, self._frozen, self.prepare_s = sandbox, frozen, time.monotonic() - t0
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
            sandbox, standby, frozen = self._sandbox, self._name, self._frozen
            self._sandbox, self._checkpoint, self._name, self._frozen = None, None, None, None
        if sandbox is None or standby is None:
            if standby is not None and not done.is_set():
                self._cancel.set()  # still preparing past the wait: it removes itself
            return None
        if frozen is not None:
            self.last_promote = {}
            promoted = promote_kernel(self.client, self.hook, checkpoint, name, standby, frozen, self.last_promote)
        else:
            promoted = promote_docker(self.client, self.hook, checkpoint, name, standby, sandbox.container_id)
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
            self._sandbox, self._checkpoint, self._name, self._frozen = None, None, None, None
            self._cancel.set()
        return name, done

    def _remove(self, name: str | None, done: threading.Event) -> None:
        done.wait(PREPARE_WAIT_S)  # a preparation still running stops at its next check
        if name is not None:
            with contextlib.suppress(Exception):
                fence.fence(self.client, name, background=False)


def _freeze(client: docker.DockerClient, cid: str, name: str) -> Frozen | None:
    """Freeze the restored standby through its cgroup and check it as a rollback would
    (Docker's view running, its init alive in the cgroup); None: no cgroup of it here,
    Docker paused it instead."""
    control = freezer.control_file(cid)
    if control is None:
        with translate_errors(f"freeze standby {name}"):
            client.api.pause(cid)
        return None
    return Frozen(cid, freeze_checked(client, cid, f"standby {name}"), control)


def freeze_checked(client: docker.DockerClient, cid: str, what: str) -> int:
    """Freeze a just-restored container through its cgroup and check it as a rollback would
    (Docker's view running, its init alive in the cgroup); returns the init's pid.
    SandboxLost otherwise. Standbys and warm forks both use it."""
    if not freezer.freeze(cid, poll_s=0.001):
        raise SandboxLost(f"{what} could not be frozen")
    with translate_errors(f"check {what}"):
        state = client.api.inspect_container(cid)["State"]
    pid = state.get("Pid", 0)
    if not (state.get("Running") and not state.get("Paused") and freezer.init_alive(cid, pid)):
        raise SandboxLost(f"{what} is not running after its restore ({state.get('Status')})")
    return pid


def promote_or_none(standby: Standby | None, checkpoint: Checkpoint, name: str) -> DockerSandbox | None:
    """``standby.promote`` where a failed promotion is one more reason to restore the usual way."""
    if standby is None:
        return None
    try:
        return standby.promote(checkpoint, name)
    except (InfraError, RestoreFailed):
        return None
