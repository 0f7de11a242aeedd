"""When to checkpoint: what the env asks and tells its policy (``CheckpointPolicy``), the two
fixed policies, and ``make_policy`` (a name or an object). The one that decides from measured
timings is ``AdaptivePolicy`` (``adaptive.py``), the default.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from belayer_core.errors import ConfigError
from belayer_env.env.adaptive import (
    STANDBY_RESERVE_BYTES,
    AdaptivePolicy,
    AdaptivePolicyConfig,
    PolicyEstimates,
    memory_fits,
)

__all__ = ["AdaptivePolicy", "AdaptivePolicyConfig", "AlwaysPolicy", "CheckpointPolicy", "NeverPolicy",
           "PolicyEstimates", "PolicyName", "make_policy"]


@runtime_checkable
class CheckpointPolicy(Protocol):
    """What the env asks and tells its checkpoint policy (all times in seconds)."""

    def should_checkpoint(self, step: int) -> bool:
        """Start a capture of boundary ``step`` now (the env just returned step ``step``)?"""

    def late_wait_s(self, elapsed_s: float) -> float:
        """The next step arrived while a capture runs ``elapsed_s`` already: wait this long
        at most for the sandbox to thaw (0 = abandon the capture now)."""

    def observe_step(self, exec_s: float, gen_s: float) -> None:
        """A step was committed: it took ``exec_s`` to run and ``gen_s`` of LLM time before it."""

    def observe_failure(self) -> None:
        """An infrastructure failure hit a step."""

    def observe_wait(self, wait_s: float) -> None:
        """A step waited ``wait_s`` for a capture to thaw the sandbox (its visible cost)."""

    def observe_capture(self, total_s: float, frozen_s: float) -> None:
        """A capture became ready."""

    def observe_capture_failed(self, timed_out: bool) -> None:
        """A capture failed or was abandoned (``timed_out``: it outlived its budget)."""

    def observe_rollback(self, to_step: int) -> None:
        """The env rolled back to ``to_step``: regeneration cost restarts from there."""

    def observe_ready(self, step: int) -> None:
        """The checkpoint of ``step`` is ready: regeneration cost restarts from there."""

    def observe_reset(self, reset_s: float) -> None:
        """A new episode's boundary 0 (fresh sandbox + setup) took ``reset_s``: what a failure
        before any checkpoint costs on top of the steps (boundary 0 may be checkpointed too)."""

    def wants_standby(self, memory_bytes: int, available_bytes: int | None) -> bool:
        """Keep a standby (the newest checkpoint pre-restored, frozen) costing ``memory_bytes``
        while the host has ``available_bytes`` (None: unknown)?"""

    def observe_standby(self, prepare_s: float) -> None:
        """A standby took ``prepare_s`` (a full restore's work, on a background thread)."""


class NeverPolicy:
    """No checkpoints: recovery always goes back to the initial state."""

    def should_checkpoint(self, step: int) -> bool:
        return False

    def late_wait_s(self, elapsed_s: float) -> float:
        return 0.0

    def observe_step(self, exec_s: float, gen_s: float) -> None: ...
    def observe_failure(self) -> None: ...
    def observe_wait(self, wait_s: float) -> None: ...
    def observe_capture(self, total_s: float, frozen_s: float) -> None: ...
    def observe_capture_failed(self, timed_out: bool) -> None: ...
    def observe_rollback(self, to_step: int) -> None: ...
    def observe_ready(self, step: int) -> None: ...
    def observe_reset(self, reset_s: float) -> None: ...
    def observe_standby(self, prepare_s: float) -> None: ...

    def wants_standby(self, memory_bytes: int, available_bytes: int | None) -> bool:
        return False


class AlwaysPolicy(NeverPolicy):
    """Checkpoint every ``every``-th boundary and always wait for it (tests, the harness)."""

    def __init__(self, every: int = 1, wait_s: float = 30.0):
        self.every, self.wait_s = max(1, every), wait_s

    def should_checkpoint(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def late_wait_s(self, elapsed_s: float) -> float:
        return max(0.0, self.wait_s - elapsed_s)

    def wants_standby(self, memory_bytes: int, available_bytes: int | None) -> bool:
        return memory_fits(memory_bytes, available_bytes, STANDBY_RESERVE_BYTES)


PolicyName = Literal["never", "always", "adaptive"]


def make_policy(spec: PolicyName | CheckpointPolicy | None) -> CheckpointPolicy:
    """A policy from its name (``gymnasium.make(..., checkpoint_policy="adaptive")``) or as is."""
    if spec is None or spec == "adaptive":
        return AdaptivePolicy()
    if spec == "never":
        return NeverPolicy()
    if spec == "always":
        return AlwaysPolicy()
    if isinstance(spec, str):
        raise ConfigError(f"checkpoint_policy must be 'never', 'always', 'adaptive' or a policy object, got {spec!r}")
    return spec
