"""``AdaptivePolicy``: when to checkpoint, learned online from the timings the env reports.

A checkpoint at boundary k pays off only if a failure is likely enough, and the work it
would save (regenerating the steps since the last ready checkpoint: LLM generation plus
execution) large enough, to beat what the agent would *see* of the capture. The capture
runs while the LLM generates the next action, so the visible cost is only the part of the
capture that outlives that generation interval. Everything here is learned online from
the durations the env reports, so the policy needs no tuning per workload.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from pydantic import ConfigDict, Field

from belayer_env.sandbox.config import StrictModel

STANDBY_RESERVE_BYTES = 1 << 30
"""A standby is never kept when it would leave the host less than this much memory."""
STANDBY_ROLLBACK_S = 0.05
"""What a rollback onto a standby costs (fence + thaw + verify), for the saving estimate."""


def memory_fits(memory_bytes: int, available_bytes: int | None, reserve_bytes: int) -> bool:
    """Unknown availability counts as short: a standby is an optimisation, never a risk."""
    return available_bytes is not None and available_bytes - memory_bytes >= reserve_bytes


class PolicyEstimates:
    """What an adaptive policy learns from measurements: failure counts and timing averages.

    Every env has its own policy, and an env often lives one episode: a handful of steps,
    far too few to learn a failure rate of a few percent or what a capture costs. The envs
    of one workload (one training run) can share one ``PolicyEstimates`` instead
    (``AdaptivePolicy(estimates=...)``), so that each new env starts from what the earlier
    ones measured. Thread-safe: envs run on threads of their own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.failures = 0
        self.readies = 0  # checkpoints that became ready (their spacing: a standby's lifetime)
        self.capture_failures = 0  # captures that failed or were abandoned
        self.capture_s: float | None = None
        self.generation_s: float | None = None
        self.wait_s: float | None = None  # measured visible cost of a capture
        self.standby_prepare_s: float | None = None

    def __deepcopy__(self, memo: dict) -> PolicyEstimates:
        """An independent copy of the figures (a forked env's policy is a deep copy)."""
        copy = PolicyEstimates()
        with self._lock:
            copy.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_lock"})
        return copy

    def count(self, *, steps: int = 0, failures: int = 0, readies: int = 0, capture_failures: int = 0) -> None:
        with self._lock:
            self.steps += steps
            self.failures += failures
            self.readies += readies
            self.capture_failures += capture_failures

    def update(self, name: str, sample: float, smoothing: float, prior: float | None = None) -> None:
        """Moving average ``name`` with ``sample`` (from ``prior`` when there is none yet;
        without a prior the first sample replaces it)."""
        with self._lock:
            old = getattr(self, name)
            old = prior if old is None else old
            setattr(self, name, sample if old is None else old + smoothing * (sample - old))


class AdaptivePolicyConfig(StrictModel):
    """Priors (used until there is data) and the knobs of the adaptive rule."""

    model_config = ConfigDict(extra="forbid")

    failure_rate: float = Field(0.01, ge=0, le=1)
    """Prior per-step probability of an infrastructure failure."""
    prior_steps: float = Field(100.0, gt=0)
    """Weight of the failure-rate prior, in steps (a Beta prior's pseudo-count)."""
    capture_s: float = Field(1.0, ge=0)
    """Prior total capture time, until one has been measured."""
    generation_s: float = Field(2.0, ge=0)
    """Prior LLM generation interval, until one has been measured."""
    smoothing: float = Field(0.3, gt=0, le=1)
    """Weight of the newest sample in the moving averages of capture and generation time."""
    on_late: Literal["wait", "abandon", "adaptive"] = "adaptive"
    """Next step arrived before the sandbox thawed: wait (up to the timeout), abandon, or
    wait only while the expected saving still exceeds the extra wait."""
    capture_timeout_s: float = Field(30.0, gt=0)
    """A capture older than this is abandoned and counted as timed out."""
    explore: bool = True
    """Take the first possible checkpoint to measure the capture time (else the prior rules)."""
    cooldown_s: float = Field(20.0, ge=0)
    """After a timed-out capture, or ``failures_to_cool`` failed ones in a row, take no new
    one for this long. One failure alone does not cool: most are the sandbox's own death (a
    fault the rollback handles) or a stranger's process in it, and a cooldown longer than the
    episode left the rest of it without checkpoints, failures then costing whole episodes."""
    failures_to_cool: int = Field(2, ge=1)
    """Failed (not timed-out) captures in a row, none ready in between, that start a cooldown
    (a mechanism that keeps failing, e.g. a process tree CRIU cannot dump)."""
    standby_reserve_bytes: int = Field(STANDBY_RESERVE_BYTES, ge=0)
    """Keep no standby that would leave the host less memory than this."""
    standby_cpu_weight: float = Field(0.05, ge=0)
    """A standby's background restore counts this much per second against the rollback
    time it saves (its CPU competes with other work, not with this agent's latency)."""
    standby_prepare_s: float = Field(1.0, gt=0)
    """Prior for a standby's preparation time, until one has been measured."""


class AdaptivePolicy:
    """Checkpoint at k iff p_fail x regen_cost(since last ready) > capture - generation."""

    def __init__(self, config: AdaptivePolicyConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, *, estimates: PolicyEstimates | None = None,
                 **overrides: float | str):
        self.config = AdaptivePolicyConfig.merged(config or AdaptivePolicyConfig(), overrides)
        self.clock = clock
        self.estimates = estimates or PolicyEstimates()
        """Failure counts and timings: this env's own, or shared with the envs of one workload."""
        self.cooldown_until = float("-inf")
        self._cost_by_step: list[float] = []  # regeneration cost of each committed step
        self._ready_step = 0
        self._reset_s: float | None = None  # boundary 0's cost (a fresh sandbox + setup), if told
        self._zero_ready = False  # a checkpoint of boundary 0 is ready: a failure keeps the setup
        self._failed_in_row = 0  # captures failed since the last ready one

    # what was learned lives in ``estimates`` (possibly shared): read-only views
    steps = property(lambda self: self.estimates.steps)
    failures = property(lambda self: self.estimates.failures)
    readies = property(lambda self: self.estimates.readies)
    capture_failures = property(lambda self: self.estimates.capture_failures)
    failed_in_row = property(lambda self: self._failed_in_row)
    capture_s = property(lambda self: self.estimates.capture_s)
    generation_s = property(lambda self: self.estimates.generation_s)
    wait_s = property(lambda self: self.estimates.wait_s)
    standby_prepare_s = property(lambda self: self.estimates.standby_prepare_s)

    # ------------------------------------------------------------------ estimates

    @property
    def failure_probability(self) -> float:
        c = self.config
        return (self.failures + c.failure_rate * c.prior_steps) / (self.steps + c.prior_steps)

    @property
    def predicted_capture_s(self) -> float:
        return self.config.capture_s if self.capture_s is None else self.capture_s

    @property
    def predicted_generation_s(self) -> float:
        return self.config.generation_s if self.generation_s is None else self.generation_s

    def regeneration_cost_s(self) -> float:
        """Seconds of generation + execution a failure now would throw away (and, with no
        checkpoint ready at all, the fresh sandbox and setup that boundary 0 cost)."""
        setup = (self._reset_s or 0.0) if self._ready_step == 0 and not self._zero_ready else 0.0
        return setup + sum(self._cost_by_step[self._ready_step:])

    def expected_saving_s(self) -> float:
        return self.failure_probability * self.regeneration_cost_s()

    def visible_cost_s(self) -> float:
        """Predicted capture time the generation bubble does not hide, or, once measured,
        what the next step really waited for the sandbox to thaw (whichever is larger)."""
        predicted = max(0.0, self.predicted_capture_s - self.predicted_generation_s)
        return predicted if self.wait_s is None else max(predicted, self.wait_s)

    # ------------------------------------------------------------------ decisions

    def should_checkpoint(self, step: int) -> bool:
        if step < self._ready_step or self.clock() < self.cooldown_until:
            return False
        if step == self._ready_step and (step > 0 or self._zero_ready or self._reset_s is None):
            return False  # ready already (boundary 0: only when the env reports what it cost)
        if self.capture_s is None and self.config.explore:
            return True  # one capture to measure what a capture costs here; priors only guess
        return self.expected_saving_s() > self.visible_cost_s()

    def wants_standby(self, memory_bytes: int, available_bytes: int | None) -> bool:
        """Keep a standby iff the memory fits and the failures expected during its life
        (until the next checkpoint replaces it) save more restore time than its background
        restore costs: p_fail x steps_per_checkpoint x (prepare - rollback) >= weight x prepare."""
        c = self.config
        if not memory_fits(memory_bytes, available_bytes, c.standby_reserve_bytes):
            return False
        prepare = c.standby_prepare_s if self.standby_prepare_s is None else self.standby_prepare_s
        lifetime_steps = max(1.0, self.steps / max(1, self.readies))
        saving = max(0.0, prepare - STANDBY_ROLLBACK_S)
        return self.failure_probability * lifetime_steps * saving >= c.standby_cpu_weight * prepare

    def observe_standby(self, prepare_s: float) -> None:
        self.estimates.update("standby_prepare_s", max(0.0, prepare_s), self.config.smoothing)

    def late_wait_s(self, elapsed_s: float) -> float:
        left = max(0.0, self.config.capture_timeout_s - elapsed_s)
        if self.config.on_late == "wait":
            return left
        if self.config.on_late == "abandon":
            return 0.0
        remaining = max(0.0, self.predicted_capture_s - elapsed_s)
        return min(left, remaining) if self.expected_saving_s() > remaining else 0.0

    # ------------------------------------------------------------------ observations

    def observe_step(self, exec_s: float, gen_s: float) -> None:
        self.estimates.count(steps=1)
        self._cost_by_step.append(max(0.0, exec_s) + max(0.0, gen_s))
        self.estimates.update("generation_s", max(0.0, gen_s), self.config.smoothing)

    def observe_failure(self) -> None:
        self.estimates.count(steps=1, failures=1)

    def observe_wait(self, wait_s: float) -> None:
        self.estimates.update("wait_s", max(0.0, wait_s), self.config.smoothing)

    def observe_capture(self, total_s: float, frozen_s: float) -> None:
        self.estimates.update("capture_s", max(0.0, total_s), self.config.smoothing)

    def observe_capture_failed(self, timed_out: bool) -> None:
        self.estimates.count(capture_failures=1)
        self._failed_in_row += 1
        if timed_out or self._failed_in_row >= self.config.failures_to_cool:
            self.cooldown_until = self.clock() + self.config.cooldown_s
        if timed_out:  # the capture cost at least the whole budget
            self.estimates.update("capture_s", self.config.capture_timeout_s, self.config.smoothing,
                                  prior=self.config.capture_s)

    def observe_ready(self, step: int) -> None:
        self.estimates.count(readies=1)
        self._failed_in_row = 0
        self._ready_step = max(self._ready_step, min(step, len(self._cost_by_step)))
        self._zero_ready = self._zero_ready or step == 0

    def observe_reset(self, reset_s: float) -> None:
        self._reset_s, self._zero_ready = max(0.0, reset_s), False

    def observe_rollback(self, to_step: int) -> None:
        del self._cost_by_step[to_step:]
        self._ready_step = min(self._ready_step, to_step)
