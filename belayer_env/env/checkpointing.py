"""The env's side of capture: one capture in flight, the ready checkpoints, retention.

The mechanism is ``capture/`` (``start_checkpoint``, ``full_checkpoint``). When to capture is
the policy's decision; this class only carries it out and reports timings back to it. What
a rollback restores, and how, is ``recovery.Recovery``'s: it reads ``ready`` and keeps its
standby in step with it (``ahead``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import docker

from belayer_core.errors import CheckpointFailed, InfraError, SandboxLost
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.capture.pending import PendingCheckpoint, reason_of, start_checkpoint
from belayer_env.common.phases import PhaseHooks
from belayer_env.env.policy import CheckpointPolicy
from belayer_env.restore.prestaging import discard_copies
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.store.manifest import Checkpoint
from belayer_env.store.store import CheckpointStore

CANCEL_THAW_S = 10.0
PRESTAGE_STOP_S = 30.0
LIVENESS_EVERY_S = 0.5
PUBLISH_WATCH_S = 120.0
"""How long a capture is watched for its publication, to start the standby at once."""
Recorder = Callable[..., Any]  # Trajectory.record


class Ahead(Protocol):
    """What is prepared from the newest ready checkpoint ahead of a rollback (the env's
    ``Recovery``: its standby), kept in step with the ready list."""

    def prepare_ahead(self, checkpoint: Checkpoint) -> None:
        """``checkpoint`` is the newest ready one, or is published and about to be (called
        under the checkpointer's lock: the watcher of a capture and its collection never race)."""

    def drop_ahead(self, checkpoint: Checkpoint) -> None:
        """``checkpoint`` is removed: nothing prepared from it may be used."""

    def clear_ahead(self) -> None:
        """A new episode: everything prepared goes."""


class Checkpointer:
    def __init__(self, policy: CheckpointPolicy, record: Recorder, hooks: PhaseHooks, *,
                 directory: str | None = None, keep: int = 3, runtime: bool = True):
        self.policy = policy
        self.ahead: Ahead | None = None
        """Told of the newest ready checkpoint as soon as it is published (``Recovery``, with ``standby=True``)."""
        self._ahead_lock = threading.RLock()
        self.on_published: list[Callable[[Checkpoint], None]] = []
        """Called (on a watcher thread) with each checkpoint as soon as it is published (the
        env: its fork pool verifies what forks of it need, ``fork_ahead``)."""
        self.record = record
        self.runtime = runtime
        self.keep = keep
        self.hooks = hooks
        """Called at the mechanism's named phases (``RecoverableSandboxEnv.add_phase_hook``)."""
        self._own_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="belayer-env-ckpt-")
        self.store = CheckpointStore(self.directory, keep=None)
        self.ready: list[Checkpoint] = []  # of the current branch, oldest first
        self._pending: PendingCheckpoint | None = None
        self._prestaging: list[PendingCheckpoint] = []  # collected; their pre-staging may still run
        self._client: docker.DockerClient | None = None
        self._pending_sandbox: DockerSandbox | None = None
        self._pending_step = 0
        self._pending_started = 0.0
        self._waited_for = False  # the step after the capture has waited for its thaw
        self.failure: dict[str, Any] | None = None  # the newest capture failure not yet reported
        self.sandbox_config: SandboxConfig | None = None
        """The settings of the sandbox captured (in memory, never read from a manifest): what
        restores of its checkpoints may ask for at most (``restore/trust.py``)."""

    # ------------------------------------------------------------------ capture

    def after_step(self, sandbox: DockerSandbox, step: int) -> bool:
        """Start a background capture of boundary ``step`` if the policy wants one."""
        self.poll(step)
        if self._pending is not None or not self.policy.should_checkpoint(step):
            return False
        self._pending = start_checkpoint(sandbox, self.store, step, runtime=self.runtime, phase_hook=self.hooks)
        self._client, self.sandbox_config = sandbox.client, sandbox.config
        self._pending_step, self._pending_started = step, time.monotonic()
        self._pending_sandbox = sandbox
        self._waited_for = False
        if self.ahead is not None or self.on_published:
            threading.Thread(target=self._when_published, args=(self._pending,), daemon=True,
                             name=f"belayer-publish-watch-{step}").start()
        return True

    def _when_published(self, pending: PendingCheckpoint) -> None:
        """Start the standby (and ``on_published``) as soon as the capture is published, not
        when the env next looks (the next step's start): a fault in that very step would
        otherwise find the standby's restore just begun and wait for all of it."""
        try:
            ckpt = pending.wait(timeout=PUBLISH_WATCH_S)
        except Exception:  # noqa: BLE001 - failed or still running: the env's poll reports it
            return
        with self._ahead_lock:
            current = ckpt is not None and self._pending is pending  # not collected, cancelled or reset meanwhile
            if current and self.ahead is not None:
                self.ahead.prepare_ahead(ckpt)
            newest = current or (ckpt is not None and bool(self.ready) and self.ready[-1].id == ckpt.id)
        if newest:
            for callback in list(self.on_published):
                with contextlib.suppress(Exception):  # a preparation ahead is an optimisation
                    callback(ckpt)

    def before_step(self, step: int) -> None:
        """Step ``step + 1`` is about to run: the sandbox must not be frozen any more.

        The first step after a capture waits for the thaw as long as the policy says, else
        abandons the capture; what it waited is reported as the capture's visible cost.
        """
        pending = self._pending
        if pending is None:
            return
        if not self._waited_for:
            self._waited_for = True
            t0 = time.monotonic()
            if not pending.thawed.is_set() and not self._wait_thaw(pending, self.policy.late_wait_s(t0 - self._pending_started)):
                self.abort_inflight(step)  # the sandbox died under the capture: nothing to wait for
                self.policy.observe_wait(time.monotonic() - t0)
                return
            if not pending.thawed.is_set() and not pending.done():
                pending.cancel()
                pending.thawed.wait(CANCEL_THAW_S)  # abandoning thaws; a sandbox still frozen fails the step
                self.policy.observe_wait(time.monotonic() - t0)
                self._pending = None
                elapsed = time.monotonic() - self._pending_started
                timeout = getattr(getattr(self.policy, "config", None), "capture_timeout_s", None)
                self._failed("checkpoint_abandoned", step, f"abandoned: the sandbox was still frozen by the "
                             f"capture of step {self._pending_step} when step {step + 1} began",
                             timed_out=timeout is not None and elapsed >= timeout)
                return
            self.policy.observe_wait(time.monotonic() - t0)
        self.poll(step)

    def _wait_thaw(self, pending: PendingCheckpoint, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the thaw; False as soon as the frozen sandbox is seen dead
        (a container killed mid-dump never thaws: CRIU and its init wait for each other)."""
        deadline = time.monotonic() + wait_s
        while not pending.thawed.wait(min(LIVENESS_EVERY_S, max(0.0, deadline - time.monotonic()))):
            if self._pending_sandbox is not None and _lost(self._pending_sandbox):
                return False
            if time.monotonic() >= deadline:
                break
        return True

    def poll(self, step: int, wait_s: float = 0.0) -> None:
        """Collect a finished capture (ready or failed); ``wait_s`` bounds the wait for it."""
        pending = self._pending
        if pending is None or (wait_s <= 0 and not pending.done()):
            return
        try:
            ckpt = pending.wait(timeout=wait_s if wait_s > 0 else None)
        except TimeoutError:
            return  # still running: keep it
        except (CheckpointFailed, InfraError) as e:  # InfraError: e.g. a fault injected at a phase
            self._pending = None
            self._failed("checkpoint_failed", step, reason_of(e), error=e)
            return
        if ckpt is None and not pending.done():
            return  # still running: keep it
        self._pending = None
        if ckpt is None:
            self._failed("checkpoint_failed", step, "the capture was cancelled")
            return
        self._prestaging = [p for p in self._prestaging if not p.prestaged.is_set()] + [pending]
        self._adopt(ckpt)
        if self.ahead is not None:
            with self._ahead_lock:
                self.ahead.prepare_ahead(ckpt)

    def _adopt(self, ckpt: Checkpoint) -> None:
        """``ckpt`` is the newest ready checkpoint: the policy and the trajectory are told,
        the oldest beyond ``keep`` removed."""
        self.ready.append(ckpt)
        self.policy.observe_capture(ckpt.total_s, ckpt.frozen_s)
        self.policy.observe_ready(ckpt.step)
        self.record("checkpoint_ready", at_step=ckpt.step)
        self._prune()

    def _failed(self, kind: str, step: int, reason: str, *, error: BaseException | None = None,
                timed_out: bool = False) -> None:
        """A capture ended without a checkpoint: the policy counts it, the trajectory records
        it, and the step that collected it says so in one line (``take_failure``). The ready
        checkpoints are untouched."""
        self.policy.observe_capture_failed(timed_out=timed_out)
        self.record(kind, at_step=step, error=error, reason=reason)
        self.failure = {"step": self._pending_step, "reason": reason}

    def take_failure(self) -> dict[str, Any] | None:
        """The newest capture failure not yet reported (``{"step", "reason"}``), once: what
        ``info["belayer"]["checkpoint_failed"]`` of the step that collected it holds."""
        failure, self.failure = self.failure, None
        return failure

    def _prune(self) -> None:
        while len(self.ready) > self.keep:
            self._remove(self.ready.pop(0))

    def _remove(self, ckpt: Checkpoint) -> None:
        """Remove a checkpoint, what was prepared from it (``ahead``) and its pre-staged copy
        on Docker's disk (one still being made is stopped first): nothing of it outlives the env."""
        if self.ahead is not None:
            self.ahead.drop_ahead(ckpt)
        for p in self._prestaging:
            if p.checkpoint is not None and p.checkpoint.id == ckpt.id:
                p.stop_prestage(PRESTAGE_STOP_S)
        self._prestaging = [p for p in self._prestaging if not p.prestaged.is_set()]
        with contextlib.suppress(Exception):
            self.store.remove(ckpt.id)
        if self._client is not None:
            with contextlib.suppress(Exception):
                discard_copies(self._client, ckpt.id)

    # ------------------------------------------------------------------ what a rollback asks of it

    def finish_or_abandon(self, step: int, wait_s: float) -> None:
        """A rollback to ``step`` or below is about to restore: collect the capture in flight
        if it finishes within ``wait_s`` (it predates the fault), else abandon it."""
        self.poll(step, wait_s=wait_s)
        if self._pending is not None:  # outlived the wait: not trustworthy in time
            self._pending.cancel()
            self._pending = None
            self.record("checkpoint_abandoned", at_step=step, reason="abandoned: still running at a recovery")

    def drop_newest(self) -> None:
        """The newest ready checkpoint is of no use to the rollback (past its boundary, or bad twice)."""
        self._remove(self.ready.pop())

    def capture_now(self, sandbox: DockerSandbox, step: int) -> Checkpoint:
        """Checkpoint boundary ``step`` now, on this thread, and keep it as the newest ready one."""
        ckpt = full_checkpoint(sandbox, self.store, step, runtime=self.runtime, phase_hook=self.hooks)
        self._client, self.sandbox_config = sandbox.client, sandbox.config
        self._adopt(ckpt)
        return ckpt

    def settle(self, step: int, timeout: float) -> None:
        """Wait (bounded) for the capture in flight to finish and collect it."""
        self.poll(step, wait_s=timeout)

    def discard_after(self, step: int) -> None:
        """Checkpoints past ``step`` belong to an abandoned branch: never restore them."""
        keep = [c for c in self.ready if c.step <= step]
        for c in self.ready:
            if c.step > step:
                self._remove(c)
        self.ready = keep

    def before_fence(self, step: int) -> None:
        """The sandbox is about to be fenced after a failure at step ``step + 1``.

        A capture past its thaw holds boundary ``step``'s state already: it is left to
        finish (the rollback waits for it: ``finish_or_abandon``). One still frozen is
        dumping a sandbox that is gone: it is aborted, CRIU included, before the fence starts.
        """
        self.poll(step)
        if self._pending is not None and not self._pending.thawed.is_set():
            self.abort_inflight(step)

    def abort_inflight(self, step: int | None = None) -> None:
        """Stop the capture in flight, CRIU included, and wait (bounded) for its thread.

        Afterwards nothing pauses or dumps a container of this name any more; a CRIU dump
        of a container that died under it would otherwise keep that container unremovable.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        with contextlib.suppress(Exception):
            pending.abort()
            pending.wait(timeout=CANCEL_THAW_S)
        if step is not None:
            self._failed("checkpoint_abandoned", step, "abandoned: the sandbox died under the capture")

    def reset(self) -> None:
        """New episode: abort the capture in flight and forget every checkpoint."""
        self.abort_inflight()
        self.failure = None
        if self.ahead is not None:
            self.ahead.clear_ahead()
        for c in self.ready:
            self._remove(c)
        self.ready = []

    def close(self) -> None:
        self.reset()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


def _lost(sandbox: DockerSandbox) -> bool:
    """Known dead (not merely unreachable: aborting a dump can damage a live sandbox)."""
    try:
        sandbox.check_alive("liveness during a capture")
    except SandboxLost:
        return True
    except Exception:  # noqa: BLE001 - daemon trouble: not proof of death
        return False
    return False

