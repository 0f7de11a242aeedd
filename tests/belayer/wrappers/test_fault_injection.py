"""FaultInjection fires real faults; the env recovers and observations stay clean."""

from __future__ import annotations

import pytest

from belayer.wrappers.fault_injection import FaultInjection
from tests.belayer_env.conftest_env import assert_no_infra_text
from tests.conftest import wait_until


def _run(env, n: int, sleep: float = 0.3) -> list[dict]:
    infos = []
    for i in range(n):
        obs, _r, _te, _tr, info = env.step(f"echo {i} >> /log; sleep {sleep}")
        assert_no_infra_text(obs)
        infos.append(info)
    return infos


@pytest.mark.parametrize("kind", ["kill", "oom", "kill_processes", "break_transport"])
def test_fault_at_given_step_causes_rollback(make_env, kind):
    env = FaultInjection(make_env(checkpoint_policy="never", memory="256m"), at_steps={2: kind},
                         max_delay_s=0.1, seed=1)
    env.reset()
    # a stream cut shortly before the command ends is not detected by the sandbox (it
    # waits 2 s for the exit code), and an OOM kill takes a moment: use a long action there
    infos = _run(env, 3, sleep=3 if kind in ("break_transport", "oom") else 0.3)
    assert "rollback" not in infos[0]["belayer"]
    assert infos[1]["belayer"]["rollback"]["to_step"] == 0, (kind, infos[1], env.injected)
    assert env.injected[0]["kind"] == kind
    assert env.unwrapped.trajectory.events[-1].kind == "rollback"


def test_probability_one_fails_every_step(make_env):
    env = FaultInjection(make_env(checkpoint_policy="never"), probability=1.0, kinds=["kill"], max_delay_s=0.0)
    env.reset()
    assert all("rollback" in i["belayer"] for i in _run(env, 2))
    assert len(env.injected) == 2


def test_fault_at_a_time_after_reset(make_env):
    env = FaultInjection(make_env(checkpoint_policy="never"), at_times={0.2: "kill"})
    env.reset()
    wait_until(lambda: env.injected, 10, "the timed fault to fire")
    wait_until(lambda: not env.unwrapped.sandbox.is_alive(), 10, "the container to die")
    assert "rollback" in env.step("true")[4]["belayer"]


def test_failed_checkpoint_publishes_nothing_and_recovery_uses_an_older_one(make_env):
    env = FaultInjection(make_env(checkpoint_policy="always"))
    env.reset()
    env.step("echo 1 >> /log")
    env.unwrapped.settle()
    env.arm("checkpoint_fail", "runtime_dumped", "raise")
    env.step("echo 2 >> /log")
    env.unwrapped.settle()
    assert [c.step for c in env.unwrapped.checkpointer.ready] == [1]
    kinds = [e.kind for e in env.unwrapped.trajectory.events]
    assert "checkpoint_failed" in kinds
    if env.unwrapped.sandbox.is_alive():
        env.fire("kill")
    obs, _r, _te, _tr, info = env.step("cat /log")
    assert info["belayer"]["rollback"]["to_step"] == 1
    assert env.step("cat /log")[0].endswith("<output>\n1\n</output>")


def test_sandbox_killed_after_the_dump_keeps_the_checkpoint(make_env):
    """The container dies once CRIU has dumped it (still frozen): what was captured is the
    boundary's state, so the checkpoint is published and recovery resumes from it."""
    env = FaultInjection(make_env(checkpoint_policy="always"))
    env.reset()
    env.step("echo 1 >> /log")
    env.unwrapped.settle()
    env.arm("checkpoint_fail", "runtime_dumped", "kill")
    env.step("echo 2 >> /log")
    env.unwrapped.settle()
    assert [c.step for c in env.unwrapped.checkpointer.ready] == [1, 2]
    wait_until(lambda: not env.unwrapped.sandbox.is_alive(), 30, "the killed sandbox to be gone")
    _obs, _r, _te, _tr, info = env.step("cat /log")
    assert info["belayer"]["rollback"]["to_step"] == 2
    assert env.step("cat /log")[0].endswith("<output>\n1\n2\n</output>")


def test_failed_restore_is_retried(make_env):
    env = FaultInjection(make_env(checkpoint_policy="always"))
    env.reset()
    env.step("echo 1 >> /log")
    env.unwrapped.settle()
    env.arm("restore_fail", "layer_installed", "raise")
    env.fire("kill")
    _obs, _r, _te, _tr, info = env.step("echo 2 >> /log")
    assert info["belayer"]["rollback"]["to_step"] == 1
    assert any(e.kind == "restore_failed" for e in env.unwrapped.trajectory.events)
    assert env.step("cat /log")[0].endswith("<output>\n1\n</output>")
