"""``Recovery``: where the env decides and performs a rollback (the env holds one).

After an infrastructure failure during step k+1 the effects of that action are unknowable,
so it is never retried: the sandbox is fenced and the newest ready checkpoint j <= k comes
back in a fresh container. What it comes back in is decided here, and only here
(``Recovery._restore_newest``), tried in this order:

1. the standby (``restore/standby.py``): boundary j restored ahead and frozen, promoted by
   fence + thaw + verify, with no byte moved; it fences the sandbox itself, through the
   kernel, so the rollback kills nothing first;
2. ``full_restore`` (``restore/restore.py``) of j into the restore spare (``restore/spare.py``)
   or a container created then, from the copy pre-staged against j's manifest
   (``restore/prestaging.py``) or else j unpacked (which of these: ``restore/plan.py``);
3. boundary 0 (``episode.EpisodeSandbox.initial_state``) when no checkpoint is usable.

A checkpoint whose restore fails twice (``RestoreFailed``: corrupt, or the runtime refused
it) is dropped and an older one tried; a restore killed by an infra fault is retried (the
checkpoint is fine, the attempt was not). The env rolls its trajectory back to the boundary
``rollback`` returns. ``Recovery`` also keeps what a rollback uses ready: the standby of the
newest ready checkpoint (``Checkpointer.ahead``) and the restore spare.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from belayer_core.errors import InfraError, RestoreFailed, SandboxLost
from belayer_env.env.checkpointing import Checkpointer
from belayer_env.env.config import EnvConfig
from belayer_env.env.episode import EpisodeSandbox
from belayer_env.env.policy import CheckpointPolicy
from belayer_env.restore.restore import full_restore
from belayer_env.restore.spare import RestoreSpare, kept_filled
from belayer_env.restore.standby import Standby, meminfo_available, promote_or_none
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.removal import remove_in_background
from belayer_env.store.manifest import Checkpoint

Recorder = Callable[..., Any]  # Trajectory.record


@dataclass(frozen=True)
class Restored:
    """A rollback done: ``sandbox`` (also the episode's now) is at boundary ``step``;
    ``detected``: when the failure was seen (``time.monotonic``); ``parts``: where the
    seconds went (``fence``, ``wait_capture``, ``restore``, ``initial``)."""

    sandbox: DockerSandbox
    step: int
    detected: float
    parts: dict[str, float]


class Recovery:
    """Decides and performs the env's rollbacks; keeps its standby and restore spare."""

    def __init__(self, config: EnvConfig, episode: EpisodeSandbox, checkpointer: Checkpointer,
                 policy: CheckpointPolicy, record: Recorder):
        self.config = config
        self.episode = episode
        self.checkpointer = checkpointer
        self.policy = policy
        self.record = record
        self.standby: Standby | None = None
        """The newest ready checkpoint pre-restored and frozen (``standby=True`` and the policy agrees)."""
        self.spare: RestoreSpare | None = None
        """A container created ahead for the next restore (``restore_spare=True``)."""
        if config.standby:
            checkpointer.ahead = self

    # ------------------------------------------------------------------ the rollback

    def rollback(self, error: InfraError, k: int) -> Restored:
        """Fence the sandbox, restore boundary j <= k (the newest usable), never retry the action.

        Raises the last ``InfraError`` when every attempt failed (the episode is over).
        """
        detected = time.monotonic()
        self.policy.observe_failure()
        self.checkpointer.before_fence(k)  # a CRIU dump still running would wedge the fence
        # a standby ready for this rollback fences the sandbox itself, through the kernel (a
        # failed promotion falls back to a restore, which fences first as well)
        onto_standby = self._standby_ready_for(k)
        dead = [] if onto_standby else self.episode.kill()
        parts = {"fence": time.monotonic() - detected}
        try:
            sandbox, j = self._restore(error, k, set(dead), parts, check_name=not onto_standby)
        finally:
            # removed once the rollback is done: deleting a big dead layer beside the restore
            # slowed a heavy one by ~0.1 s (benchmarks/restore_bench.py, prestaged_lost)
            remove_in_background(self.episode.client, dead)
        return Restored(sandbox, j, detected, parts)

    def _restore(self, error: InfraError, k: int, fenced: set[str], parts: dict[str, float],
                 check_name: bool) -> tuple[DockerSandbox, int]:
        t = time.monotonic()
        if check_name and self.episode.name_blocked(fenced):
            # a container of this name cannot be removed (e.g. wedged by a hung CRIU dump):
            # checkpoints restore under this name, so only boundary 0, under a new name, is left
            self.record("restore_failed", at_step=k, error=SandboxLost(f"cannot fence {self.episode.name}"))
            self.checkpointer.discard_after(-1)  # a checkpoint of boundary 0 would restore under it too
            self.episode.name = self.episode.new_name()
        parts["fence"] += time.monotonic() - t
        last: InfraError = error
        for _ in range(self.config.recovery_attempts):
            try:
                sandbox, j = self._newest_or_initial(k, parts)
                break
            except InfraError as e:  # the fresh sandbox failed too: fence it and try again
                last = e
                self.record("restore_failed", at_step=k, error=e)
                self.episode.fence(wait_removed=False)
        else:
            raise last
        self.episode.sandbox = sandbox
        if self.spare is not None:  # the restored sandbox is made as the one it was made for
            self.spare.fill()
        self.checkpointer.discard_after(j)
        self.policy.observe_rollback(j)
        return sandbox, j

    def _newest_or_initial(self, k: int, parts: dict[str, float]) -> tuple[DockerSandbox, int]:
        """The newest usable checkpoint at or below ``k``, else boundary 0."""
        t = time.monotonic()
        self.checkpointer.finish_or_abandon(k, wait_s=self.config.pending_wait_s)
        parts["wait_capture"] = parts.get("wait_capture", 0.0) + time.monotonic() - t
        t = time.monotonic()
        try:
            restored = self._restore_newest(k)
        finally:
            parts["restore"] = parts.get("restore", 0.0) + time.monotonic() - t
        if restored is not None:
            return restored
        t = time.monotonic()
        self.episode.fence(wait_removed=False)  # a failed restore may have left a container of this name
        sandbox = self.episode.initial_state()
        parts["initial"] = parts.get("initial", 0.0) + time.monotonic() - t
        return sandbox, 0

    def _restore_newest(self, k: int) -> tuple[DockerSandbox, int] | None:
        """The decision: the standby of the newest ready checkpoint j <= k if there is one,
        else ``full_restore`` of j (into the spare where it fits); older ones after failures.
        None: no checkpoint is left to restore."""
        tries, failures = 0, {}
        while self.checkpointer.ready and tries < self.config.recovery_attempts:
            ckpt = self.checkpointer.ready[-1]
            if ckpt.step > k:
                self.checkpointer.drop_newest()
                continue
            tries += 1
            if tries == 1 and (sandbox := promote_or_none(self.standby, ckpt, ckpt.sandbox)) is not None:
                self.record("standby_promoted", at_step=k, to_step=ckpt.step)
                return sandbox, ckpt.step
            try:
                sandbox = full_restore(ckpt, allow_degraded=self.config.allow_degraded, client=self.episode.client,
                                       phase_hook=self.checkpointer.hooks, spare=self.spare,
                                       config=self.checkpointer.sandbox_config)
            except RestoreFailed as e:
                self.record("restore_failed", at_step=k, error=e, to_step=ckpt.step)
                failures[ckpt.id] = failures.get(ckpt.id, 0) + 1
                if not _transient(e) and failures[ckpt.id] >= 2:  # bad twice: fall back to an older one
                    self.checkpointer.drop_newest()
                continue
            except InfraError as e:
                self.record("restore_failed", at_step=k, error=e, to_step=ckpt.step)
                continue
            if sandbox.degraded:
                self.record("degraded_restore", at_step=k, to_step=ckpt.step)
            return sandbox, ckpt.step
        return None

    def _standby_ready_for(self, k: int) -> bool:
        """A prepared standby of the checkpoint a rollback at ``k`` tries first."""
        ready = [c for c in self.checkpointer.ready if c.step <= k]
        standby = self.standby
        return (bool(ready) and standby is not None and standby.ready() and standby.checkpoint is not None
                and standby.checkpoint.id == ready[-1].id)

    # ------------------------------------------------------------------ the standby (``Checkpointer.ahead``)

    def prepare_ahead(self, ckpt: Checkpoint) -> None:
        """Pre-restore ``ckpt`` into the (one) standby when the policy wants it; a standby of
        an older checkpoint is discarded either way (it would roll back further)."""
        if self.standby is not None and self.standby.checkpoint is not None and self.standby.checkpoint.id == ckpt.id:
            return  # prepared as soon as it was published
        if self.standby is None:
            self.standby = Standby(self.episode.client, phase_hook=self.checkpointer.hooks)
        if self.standby.ready() and self.standby.prepare_s is not None:
            self.policy.observe_standby(self.standby.prepare_s)
        if self.policy.wants_standby(ckpt.size_bytes, meminfo_available()):
            self.standby.config = self.checkpointer.sandbox_config
            self.standby.prepare(ckpt)
            self.record("standby_preparing", at_step=ckpt.step)
        else:
            self.standby.discard(background=True)

    def drop_ahead(self, ckpt: Checkpoint) -> None:
        if self.standby is not None and self.standby.checkpoint is not None and self.standby.checkpoint.id == ckpt.id:
            self.standby.discard(background=True)

    def clear_ahead(self) -> None:
        if self.standby is not None:
            self.standby.discard()

    # ------------------------------------------------------------------ the restore spare

    def refill_spare(self) -> None:
        """Top up the restore spare (config ``restore_spare``) for the episode's sandbox, named
        apart from any episode's sandbox: it outlives resets (a new name each)."""
        self.spare = kept_filled(self.spare, self.config.restore_spare, self.episode.sandbox,
                                 lambda sb: RestoreSpare(sb, new_name=lambda: f"{self.episode.new_name()}-spare"))

    def close(self) -> None:
        if self.spare is not None:
            self.spare.close()
        self.spare = None


def _transient(error: RestoreFailed) -> bool:
    """A restore that died of an infra fault (not of the checkpoint's content) may be retried."""
    cause = error.__cause__
    return isinstance(cause, InfraError) and not isinstance(cause, RestoreFailed)
