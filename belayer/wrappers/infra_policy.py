"""One policy for infrastructure failures, the same in every trainer adapter.

A sample that an infrastructure failure touched is, in this order:

1. **recovered**: the env restores a ready checkpoint (rollback) and the engine continues a
   broken generation on a shadow or another worker (failover); the sample goes on;
2. else **retried with a fresh sandbox**: when the env's own recovery is exhausted (an
   ``InfraError`` out of ``step``/``reset``), ``PolicyEnv`` resets the same env (a new
   container, the task's setup run again) and reports a rollback to boundary 0
   (``info["belayer"]["rollback"] = {"to_step": 0, "reason": ..., "fresh_sandbox": n}``), so
   every adapter that already cuts its context on a rollback regenerates the sample from
   its prompt: nothing is replayed on the new sandbox;
3. else **dropped with its group and counted**: after ``InfraPolicy.retries`` fresh sandboxes
   ``PolicyEnv`` raises ``SampleDropped`` (an ``InfraError``); the adapter gives its trainer
   "no sample" in the trainer's own terms, never a reward of 0 or below, and the other
   samples of its group (GRPO's baseline) go with it.

Why retry before dropping: dropping only the samples that hit failures biases the data
toward tasks whose sandboxes do not fail (long or heavy episodes fail more often), and a
zero reward for a failure teaches the policy that its actions caused it (NeMo-RL #3589).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import gymnasium as gym
from pydantic import ConfigDict, Field

from belayer_core.errors import InfraError
from belayer_env.sandbox.config import StrictModel


class InfraPolicy(StrictModel):
    """What an adapter does with a sample whose env recovery is exhausted."""

    model_config = ConfigDict(extra="forbid")

    retries: int = Field(2, ge=0)
    """Fresh sandboxes a sample may start over in once the env's recovery is exhausted; 0 drops it at once."""
    max_rollbacks: int = Field(16, ge=0)
    """Rollbacks one sandbox may take; one more counts as exhausted recovery (a fault that keeps coming back)."""
    drop_group: bool = True
    """A dropped sample takes the other samples of its group with it (a GRPO group's baseline
    is biased without it). False keeps them (for trainers without groups)."""


class SampleDropped(InfraError):
    """The env's recovery and every fresh-sandbox retry failed: this sample is not returned."""

    def __init__(self, attempts: list[dict[str, Any]]):
        reasons = ", ".join(a["error"] for a in attempts)
        super().__init__(f"sample dropped after {len(attempts)} unrecoverable infrastructure failure(s): {reasons}")
        self.attempts = attempts


class RollbackBudgetSpent(InfraError):
    """The sandbox was rolled back more than ``InfraPolicy.max_rollbacks`` times."""


class PolicyEnv(gym.Wrapper):
    """``InfraPolicy``'s retry around a ``RecoverableSandboxEnv`` (or any wrapper of one).

    ``attempts`` lists the failures that started a fresh sandbox (error type, the boundary it
    was at, the infra events of the lost attempt); ``label()`` is what adapters put in the
    sample's metadata."""

    def __init__(self, env: gym.Env, policy: InfraPolicy | None = None):
        super().__init__(env)
        self.policy = policy or InfraPolicy()
        self.attempts: list[dict[str, Any]] = []
        self._reset_kwargs: dict[str, Any] = {}
        self._rollbacks = 0  # of the current sandbox

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        self.attempts, self._rollbacks = [], 0
        self._reset_kwargs = kwargs
        while True:
            try:
                return self.env.reset(**kwargs)
            except InfraError as e:
                self._failed(e, at_step=0)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        return self._guarded(self.env.step, action)

    def step_command(self, action: str, **kwargs: Any) -> tuple[Any, float, bool, bool, dict]:
        """``RecoverableSandboxEnv.step_command`` under the policy (mini-swe-agent's cwd/timeout)."""
        return self._guarded(self.env.unwrapped.step_command, action, **kwargs)

    def label(self) -> dict[str, Any]:
        """``{"fresh_sandbox_retries": n, "retried_after": [...]}`` for the sample's metadata."""
        return {"fresh_sandbox_retries": len(self.attempts),
                "retried_after": [{k: a[k] for k in ("error", "at_step")} for a in self.attempts]}

    # ------------------------------------------------------------------ internals

    def _guarded(self, step, action: Any, **kwargs: Any) -> tuple[Any, float, bool, bool, dict]:
        k = len(self.env.unwrapped.trajectory.steps)
        try:
            result = step(action, **kwargs)
        except InfraError as e:
            self._failed(e, at_step=k)
            return self._fresh_sandbox(type(e).__name__)
        if "rollback" in result[4].get("belayer", {}):
            self._rollbacks += 1
            if self._rollbacks > self.policy.max_rollbacks:
                self._failed(RollbackBudgetSpent(f"more than {self.policy.max_rollbacks} rollbacks"), at_step=k)
                return self._fresh_sandbox(RollbackBudgetSpent.__name__)
        return result

    def _failed(self, error: InfraError, at_step: int) -> None:
        """Record the lost attempt; raise ``SampleDropped`` when the retries are spent."""
        trajectory = self.env.unwrapped.trajectory
        self.attempts.append({"error": type(error).__name__, "message": str(error)[:300], "at_step": at_step,
                              "events": [e.model_dump(mode="json") for e in trajectory.events]})
        if isinstance(error, SampleDropped) or len(self.attempts) > self.policy.retries:
            raise SampleDropped(self.attempts) from error

    def _fresh_sandbox(self, reason: str) -> tuple[Any, float, bool, bool, dict]:
        self._rollbacks = 0
        while True:
            try:
                obs, info = self.env.reset(**self._reset_kwargs)
                break
            except InfraError as e:
                self._failed(e, at_step=0)
        info = dict(info)
        info["belayer"] = {**info.get("belayer", {}), "step": 0,
                           "rollback": {"to_step": 0, "reason": reason, "fresh_sandbox": len(self.attempts)}}
        return obs, 0.0, False, False, info


def drop_mask(groups: Iterable[Hashable], dropped: Iterable[bool], policy: InfraPolicy | None = None) -> list[bool]:
    """Per sample, whether the trainer must not train on it: the dropped ones and, with
    ``policy.drop_group`` (default), every sample that shares a group key with one."""
    policy = policy or InfraPolicy()
    groups, dropped = list(groups), list(dropped)
    hit = {g for g, d in zip(groups, dropped, strict=True) if d} if policy.drop_group else set()
    return [d or g in hit for g, d in zip(groups, dropped, strict=True)]
