"""``ResumableSandboxEnv``: a ``RecoverableSandboxEnv`` whose episode can continue on another node.

Its checkpoints go through a ``ReplicatedCheckpointStore``: each is committed at a shared
fsspec URL, with the episode's record (task, setup, committed steps 1..j), before the env
calls it ready. ``resume_point()`` names the newest ready one; a fresh env on any machine
that reaches the URL and has the same image continues the episode from it with
``resume(checkpoint_id, at_step=k)``: the replica is downloaded and checked, restored
with the ordinary ``full_restore``, and the return value is that of any rollback, with the
same ``info["belayer"]["rollback"]`` keys. Nothing here imports Ray.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from belayer_core.errors import CheckpointNotFound, InfraError, NodeLost
from belayer_env.env.recoverable import EnvConfig, RecoverableSandboxEnv
from belayer_env.env.trajectory import InfraEvent, StepRecord, Trajectory
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.store.replica import ReplicaLocation, ReplicatedCheckpointStore


class ResumableSandboxEnv(RecoverableSandboxEnv):
    """``RecoverableSandboxEnv`` + replicated checkpoints + ``resume`` (see the module doc)."""

    def __init__(self, config: EnvConfig | None = None, *, replica_url: str,
                 replica_options: dict[str, Any] | None = None, replica_key_file: str | None = None,
                 **kwargs: Any):
        super().__init__(config, **kwargs)
        self.replica = ReplicaLocation(replica_url, key_file=replica_key_file, **(replica_options or {}))
        local = self.checkpointer.store
        self.checkpointer.store = ReplicatedCheckpointStore(
            local.path, self.replica, keep=None,
            max_layer_bytes=local.max_layer_bytes, episode=self._episode_record)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        old = self.name
        out = super().reset(seed=seed, options=options)
        if old:  # the previous episode's replicas
            self.replica.remove_sandbox(old)
        return out

    def step_command(self, action: str, **kwargs: Any) -> tuple[str, float, bool, bool, dict]:
        out = super().step_command(action, **kwargs)
        rollback = out[4]["belayer"].get("rollback")
        if rollback is not None:  # a local recovery abandoned steps > j: so are their replicas
            for rep in self.replica.list(self.name):
                if rep.step > rollback["to_step"]:
                    self.replica.remove(rep.id)
        return out

    def close(self) -> None:
        """``RecoverableSandboxEnv.close`` + every replica of this episode's sandbox."""
        super().close()
        if self.name:
            self.replica.remove_sandbox(self.name)

    def _episode_record(self, step: int) -> dict[str, Any]:
        """What a resume of boundary ``step`` needs besides the checkpoint itself."""
        steps = self.trajectory.steps[:step]
        if len(steps) != step:
            raise InfraError(f"boundary {step} is not committed (only {len(steps)} steps)")
        return {"task": self.trajectory.task, "setup": list(self.episode.setup), "image": self.episode.config.image,
                "steps": [s.model_dump(mode="json") for s in steps]}

    def resume_point(self) -> dict[str, Any] | None:
        """The newest ready (hence replicated) checkpoint of this branch: ``{"id", "step"}``."""
        ready = self.checkpointer.ready
        return {"id": ready[-1].id, "step": ready[-1].step} if ready else None

    def resume(self, checkpoint_id: str | None, *, at_step: int, options: dict[str, Any] | None = None,
               error: BaseException | None = None) -> tuple[str, dict]:
        """Continue a lost episode from replica ``checkpoint_id`` (None: from boundary 0).

        ``at_step`` is the boundary the agent had reached when the episode was lost;
        ``options`` are its reset options (used when it has to start over from boundary 0).
        An unusable replica falls back to an older one of the same sandbox, then to
        boundary 0. Returns ``(observation, info)`` of the boundary restored, as a rollback.
        """
        error = error or NodeLost(f"the node running the episode was lost at boundary {at_step}")
        self.checkpointer.reset()
        self.episode.fence()
        self.episode.sandbox = None
        self._done = True
        restored = self._restore_replica(checkpoint_id, at_step) if checkpoint_id else None
        if restored is None:  # boundary 0: the task from scratch, under a new name
            if checkpoint_id:  # the lost sandbox's replicas are of no use any more
                with contextlib.suppress(Exception):
                    self.replica.remove_sandbox(checkpoint_id.rsplit(".", 2)[0])
            failed = self.trajectory.events
            obs, _ = self.reset(options=options)
            self.trajectory.events[:0] = failed  # why the replica was not used
            j, discarded = 0, at_step
        else:
            ck, episode = restored
            j, discarded = ck.step, at_step - ck.step
            obs = self.trajectory.observation_at(j) or self.trajectory.task
            self.replica.remove_sandbox(ck.sandbox, keep=ck.id)  # other branches' and older replicas
        self.policy.observe_failure()
        self.policy.observe_rollback(j)
        self.trajectory.events.append(InfraEvent(
            kind="rollback", at_step=at_step, to_step=j, error=type(error).__name__,
            message=str(error)[:2000], discarded_steps=max(discarded, 0)))
        self._last_return = time.monotonic()
        return obs, {"belayer": {"step": j, "rollback": {"to_step": j, "reason": type(error).__name__}}}

    def _restore_replica(self, checkpoint_id: str, at_step: int) -> tuple[Any, dict] | None:
        """Fetch + restore ``checkpoint_id`` (or an older replica of its sandbox); None if none works."""
        try:
            first = self.replica.get(checkpoint_id)
        except CheckpointNotFound as e:
            self._record("restore_failed", at_step=at_step, error=e)
            return None
        try:  # an older replica is used only if its episode is a prefix of this one's
            prefix = (self.replica.episode(first.id) or {}).get("steps")
        except Exception:  # noqa: BLE001 - unreadable: no fallback can be checked against it
            prefix = None
        older = [r for r in self.replica.list(first.sandbox)
                 if r.step < first.step and prefix and self._same_prefix(r.id, prefix)]
        for rep in [first, *reversed(older)]:
            for _ in range(self.config.recovery_attempts):
                try:
                    episode = self.replica.episode(rep.id)
                    if episode is None:
                        raise CheckpointNotFound(f"replica {rep.id} holds no episode record")
                    ck = self.replica.fetch(rep.id, self.checkpointer.store)
                    self.episode.name = ck.sandbox
                    # this env's settings bound the restore; the task's image comes from the
                    # episode record, which the replica's signed marker covers
                    allowed = SandboxConfig.merged(self.config.sandbox,
                                                   {"image": episode["image"]} if episode.get("image") else {})
                    sandbox = full_restore(ck, allow_degraded=self.config.allow_degraded, client=self.client,
                                           phase_hook=self.checkpointer.hooks, config=allowed)
                    self.episode.config = ck.config
                except CheckpointNotFound as e:  # corrupt or gone: an older one
                    self._record("restore_failed", at_step=at_step, error=e, to_step=rep.step)
                    break
                except (InfraError, OSError) as e:
                    self._record("restore_failed", at_step=at_step, error=e, to_step=rep.step)
                    continue
                self._adopt(sandbox, ck, episode)
                return ck, episode
        return None

    def _same_prefix(self, checkpoint_id: str, steps: list[dict[str, Any]]) -> bool:
        try:
            theirs = (self.replica.episode(checkpoint_id) or {}).get("steps") or []
        except Exception:  # noqa: BLE001 - unreadable: not usable
            return False
        return bool(theirs) and theirs == steps[: len(theirs)]

    def _adopt(self, sandbox: Any, ck: Any, episode: dict[str, Any]) -> None:
        steps = [StepRecord(**s) for s in episode["steps"]]
        self.trajectory = Trajectory(task=episode["task"], steps=steps)
        self.episode.setup = list(episode["setup"])
        self.episode.sandbox = sandbox
        self.checkpointer.ready = [ck]
        self.policy.observe_ready(ck.step)
        if getattr(sandbox, "degraded", False):
            self._record("degraded_restore", at_step=ck.step, to_step=ck.step)
        self._done = False
