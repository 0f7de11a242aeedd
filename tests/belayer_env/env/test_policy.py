"""The adaptive checkpoint rule, fed with timings (a settable clock: no sleeping)."""

from __future__ import annotations

import pytest

from belayer_core.errors import ConfigError
from belayer_env.env.policy import (
    AdaptivePolicy,
    AlwaysPolicy,
    CheckpointPolicy,
    NeverPolicy,
    PolicyEstimates,
    make_policy,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_all_policies_satisfy_the_protocol():
    for p in (NeverPolicy(), AlwaysPolicy(), AdaptivePolicy()):
        assert isinstance(p, CheckpointPolicy)


def test_make_policy_by_name_and_rejects_unknown():
    assert isinstance(make_policy("never"), NeverPolicy)
    assert isinstance(make_policy("always"), AlwaysPolicy)
    assert isinstance(make_policy("adaptive"), AdaptivePolicy)
    custom = AlwaysPolicy(every=3)
    assert make_policy(custom) is custom
    with pytest.raises(ConfigError, match="checkpoint_policy"):
        make_policy("sometimes")


def test_no_checkpoint_before_any_work():
    p = AdaptivePolicy()
    assert not p.should_checkpoint(0)


def test_capture_hidden_in_the_generation_bubble_is_taken():
    # capture (0.4 s) shorter than the LLM's generation (3 s): no visible cost at all
    p = AdaptivePolicy(capture_s=0.4)
    p.observe_step(exec_s=0.2, gen_s=3.0)
    assert p.visible_cost_s() == 0.0
    assert p.should_checkpoint(1)


def test_capture_longer_than_bubble_waits_until_enough_work_is_at_risk():
    # capture 10 s, generation 1 s: visible 9 s; p = 0.01 (a firm prior): needs > 900 s at risk
    p = AdaptivePolicy(capture_s=10.0, failure_rate=0.01, prior_steps=1e9, explore=False)
    k = 0
    while not p.should_checkpoint(k):
        p.observe_step(exec_s=9.0, gen_s=1.0)  # 10 s of regeneration cost per step
        k += 1
        assert k < 200
    saving_at_k = p.expected_saving_s()
    assert saving_at_k > p.visible_cost_s()
    # it fired exactly when failure_probability x cost first exceeded the visible cost
    assert p.failure_probability * (p.regeneration_cost_s() - 10.0) <= p.visible_cost_s()


def test_ready_checkpoint_resets_the_cost_at_risk():
    p = AdaptivePolicy(capture_s=5.0, generation_s=0.0, failure_rate=0.05, explore=False)
    for _ in range(20):
        p.observe_step(exec_s=5.0, gen_s=0.0)
    assert p.regeneration_cost_s() == pytest.approx(100.0)
    p.observe_ready(20)
    assert p.regeneration_cost_s() == 0.0
    assert not p.should_checkpoint(20)


def test_failure_rate_is_learned_online():
    p = AdaptivePolicy(failure_rate=0.01, prior_steps=100)
    before = p.failure_probability
    for _ in range(10):
        p.observe_failure()
    assert p.failure_probability > before
    for _ in range(10_000):
        p.observe_step(0.1, 0.1)
    assert p.failure_probability == pytest.approx(10 / 10_010 + 1 / 10_100, rel=0.2)


def test_measured_capture_time_replaces_the_prior():
    p = AdaptivePolicy(capture_s=1.0, smoothing=1.0)
    p.observe_capture(total_s=7.5, frozen_s=0.1)
    assert p.predicted_capture_s == 7.5
    p.observe_step(0.0, 2.5)
    assert p.visible_cost_s() == pytest.approx(5.0)


def test_cooldown_after_a_timed_out_capture():
    clock = Clock()
    p = AdaptivePolicy(clock=clock, capture_s=0.1, cooldown_s=20.0, capture_timeout_s=30.0)
    p.observe_step(1.0, 5.0)
    assert p.should_checkpoint(1)
    p.observe_capture_failed(timed_out=True)
    assert p.predicted_capture_s > 0.1  # a timeout is evidence of a slow capture
    p.observe_step(1.0, 50.0)  # even a long bubble: still cooling down
    clock.now += 19.9
    assert not p.should_checkpoint(2)
    clock.now += 0.2
    assert p.should_checkpoint(2)


def test_rollback_drops_the_cost_of_discarded_steps():
    p = AdaptivePolicy()
    for _ in range(5):
        p.observe_step(1.0, 1.0)
    p.observe_ready(2)
    p.observe_rollback(2)
    assert p.regeneration_cost_s() == 0.0
    p.observe_rollback(0)
    assert p._ready_step == 0


@pytest.mark.parametrize("mode,expect_wait", [("wait", True), ("abandon", False)])
def test_late_capture_wait_or_abandon(mode, expect_wait):
    p = AdaptivePolicy(on_late=mode, capture_timeout_s=30.0)
    assert (p.late_wait_s(elapsed_s=2.0) > 0) is expect_wait
    assert p.late_wait_s(elapsed_s=31.0) == 0.0


def test_adaptive_late_wait_only_while_saving_exceeds_the_wait():
    p = AdaptivePolicy(on_late="adaptive", capture_s=2.0, failure_rate=0.01)
    p.observe_step(1.0, 1.0)  # little at risk: 0.01 x 2 s << 1.5 s remaining
    assert p.late_wait_s(elapsed_s=0.5) == 0.0
    p2 = AdaptivePolicy(on_late="adaptive", capture_s=2.0, failure_rate=0.5)
    for _ in range(10):
        p2.observe_step(10.0, 10.0)
    assert p2.late_wait_s(elapsed_s=0.5) == pytest.approx(1.5)


def test_always_every_n():
    p = AlwaysPolicy(every=3)
    assert [k for k in range(10) if p.should_checkpoint(k)] == [3, 6, 9]


def test_first_capture_is_taken_to_measure_it():
    p = AdaptivePolicy(capture_s=100.0)  # a pessimistic prior would never checkpoint
    p.observe_step(0.1, 0.1)
    assert p.should_checkpoint(1)
    p.observe_capture(total_s=100.0, frozen_s=0.1)
    p.observe_ready(1)
    p.observe_step(0.1, 0.1)
    assert not p.should_checkpoint(2)  # now measured, and really too slow


def test_measured_wait_for_thaw_is_a_visible_cost():
    p = AdaptivePolicy(capture_s=0.5, failure_rate=0.01, prior_steps=1e9, smoothing=1.0)
    p.observe_capture(total_s=0.5, frozen_s=0.2)
    p.observe_ready(0)
    for _ in range(3):
        p.observe_step(exec_s=1.0, gen_s=1.0)  # bubble (1 s) hides the capture (0.5 s) on paper
    assert p.visible_cost_s() == 0.0 and p.should_checkpoint(3)
    p.observe_wait(0.4)  # ...but the next step really waited 0.4 s for the thaw
    assert p.visible_cost_s() == pytest.approx(0.4)
    assert not p.should_checkpoint(3)  # 0.01 x 6 s at risk < 0.4 s


def test_envs_of_one_workload_share_what_they_learned():
    # one env lives one episode (a few steps): alone it never learns a 25 % failure rate
    shared = PolicyEstimates()
    first = AdaptivePolicy(estimates=shared, failure_rate=0.01, prior_steps=100)
    for _ in range(100):
        first.observe_step(exec_s=1.0, gen_s=2.0)
        first.observe_failure()
    first.observe_capture(total_s=0.5, frozen_s=0.1)
    alone = AdaptivePolicy(failure_rate=0.01, prior_steps=100)
    later = AdaptivePolicy(estimates=shared, failure_rate=0.01, prior_steps=100)
    assert later.failure_probability == pytest.approx(101 / 300)
    assert alone.failure_probability == pytest.approx(0.01)
    assert later.capture_s == 0.5 and later.generation_s == 2.0  # measured, not the priors
    # per-env state stays per env: the later env has nothing at risk yet
    assert later.regeneration_cost_s() == 0.0 and first.regeneration_cost_s() > 0.0


def test_shared_capture_measurement_ends_exploration_for_later_envs():
    shared = PolicyEstimates()
    first = AdaptivePolicy(estimates=shared, capture_s=100.0)
    first.observe_step(0.1, 0.1)
    assert first.should_checkpoint(1)  # nothing measured yet: explore
    first.observe_capture(total_s=100.0, frozen_s=0.1)
    later = AdaptivePolicy(estimates=shared, capture_s=100.0)
    later.observe_step(0.1, 0.1)
    assert not later.should_checkpoint(1)  # measured by the first env, and really too slow


def test_boundary_zero_is_checkpointed_only_when_its_setup_cost_is_known_and_worth_it():
    p = AdaptivePolicy(capture_s=0.5, generation_s=2.0, failure_rate=0.05, explore=False)
    assert not p.should_checkpoint(0)  # no reset reported: nothing known at risk
    p.observe_reset(4.0)  # a fresh sandbox + setup took 4 s
    assert p.regeneration_cost_s() == pytest.approx(4.0)  # a failure now redoes the setup
    assert p.should_checkpoint(0)  # 0.05 x 4 s > 0 s visible (the capture hides in generation)
    p.observe_ready(0)
    assert not p.should_checkpoint(0) and p.regeneration_cost_s() == 0.0
    p.observe_step(exec_s=1.0, gen_s=2.0)
    assert p.regeneration_cost_s() == pytest.approx(3.0)  # the setup is safe in checkpoint 0
    p.observe_reset(4.0)  # a new episode: nothing of it is checkpointed
    p.observe_rollback(0)
    assert p.regeneration_cost_s() == pytest.approx(4.0)


def test_a_slow_capture_is_not_taken_for_a_cheap_setup():
    p = AdaptivePolicy(capture_s=10.0, generation_s=1.0, failure_rate=0.05, prior_steps=1e9, explore=False)
    p.observe_reset(2.0)
    assert not p.should_checkpoint(0)  # 0.05 x 2 s < 9 s visible


def test_a_deep_copy_is_independent():
    # env.fork(n) deep-copies the parent's policy: the figures are copied, not shared
    import copy

    p = AdaptivePolicy(capture_s=0.4)
    p.observe_step(exec_s=1.0, gen_s=2.0)
    p.observe_failure()
    child = copy.deepcopy(p)
    assert (child.steps, child.failures, child.generation_s) == (2, 1, 2.0)
    child.observe_failure()
    assert (p.failures, child.failures) == (1, 2)
    assert child.regeneration_cost_s() == p.regeneration_cost_s() == pytest.approx(3.0)


def test_one_failed_capture_does_not_cool_down_two_in_a_row_do():
    """A capture that fails once (its sandbox was killed under it, a stranger's exec ran) must
    not leave the rest of the episode without checkpoints; one that keeps failing cools."""
    clock = Clock()
    p = AdaptivePolicy(clock=clock, capture_s=0.1, cooldown_s=20.0)
    p.observe_step(1.0, 5.0)
    p.observe_capture_failed(timed_out=False)
    assert p.should_checkpoint(1)
    p.observe_ready(1)  # a ready one in between: the count starts again
    p.observe_step(1.0, 5.0)
    p.observe_capture_failed(timed_out=False)
    assert p.should_checkpoint(2)
    p.observe_capture_failed(timed_out=False)
    assert not p.should_checkpoint(2)
    clock.now += 20.1
    assert p.should_checkpoint(2)
