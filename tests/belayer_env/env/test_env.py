"""RecoverableSandboxEnv: Gymnasium contract, mini-swe-agent step semantics, rewards, cleanup."""

from __future__ import annotations

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

from belayer_core.errors import UsageError
from belayer_env.env.recoverable import SUBMIT_MARKER, RecoverableSandboxEnv
from belayer_env.env.rewards import CommandReward, SubmissionReward
from tests.belayer_env.conftest_env import containers_of


def test_check_env_passes(make_env):
    env = make_env(checkpoint_policy="never")
    check_env(env)


def test_gymnasium_make_after_import(docker_client):
    import belayer_env  # noqa: F401 - registers on import

    env = gym.make("belayer/Sandbox-v0", checkpoint_policy="always")
    try:
        assert isinstance(env.unwrapped, RecoverableSandboxEnv)
        obs, info = env.reset(options={"task": "say hi"})
        assert obs == "say hi" and info["belayer"]["step"] == 0
        name = env.unwrapped.name
    finally:
        env.close()
    assert not containers_of(docker_client, name)


def test_registration_is_idempotent_and_needs_no_prior_import():
    import subprocess
    import sys

    from belayer_env.registration import ENV_ID, register_envs

    register_envs()
    register_envs()  # idempotent
    assert gym.spec(ENV_ID).entry_point == "belayer_env.env.recoverable:RecoverableSandboxEnv"
    # a fresh interpreter that never imported belayer_env: the module-qualified id works
    code = ("import gymnasium as g; e = g.make('belayer_env:belayer/Sandbox-v0'); "
            "print(type(e.unwrapped).__name__); e.close()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "RecoverableSandboxEnv", r.stderr


def test_observation_space_admits_any_text(make_env):
    env = make_env(checkpoint_policy="never")
    env.reset()
    obs, _r, _te, _tr, info = env.step("printf 'a b\\t\"quoted\" & <tag> ünïcödé 🙂\\n'; exit 3")
    assert obs in env.observation_space
    assert "a b\t\"quoted\" & <tag> ünïcödé 🙂" in obs
    assert "<returncode>3</returncode>" in obs and info["returncode"] == 3
    assert "ls -la | grep 'x y'" in env.action_space


def test_setup_and_task_options(make_env):
    env = make_env(checkpoint_policy="never")
    obs, _ = env.reset(options={"task": "fix it", "setup": ["mkdir -p /repo", "echo v1 > /repo/f"]})
    assert obs == "fix it"
    assert "v1" in env.step("cat /repo/f")[0]
    with pytest.raises(UsageError, match="setup failed"):
        env.reset(options={"setup": "exit 7"})


def test_submit_convention_terminates_with_submission(make_env):
    env = make_env(checkpoint_policy="never", reward=SubmissionReward("42"))
    env.reset()
    # not first line, or nonzero exit: not a submission (mini-swe-agent's rule)
    assert env.step(f"echo x; echo {SUBMIT_MARKER}")[2] is False
    assert env.step(f"echo {SUBMIT_MARKER}; exit 1")[2] is False
    obs, reward, terminated, truncated, info = env.step(f"printf '  {SUBMIT_MARKER}\\n42\\n'")
    assert terminated and not truncated
    assert info["submission"].strip() == "42" and reward == 1.0
    with pytest.raises(UsageError, match="reset"):
        env.step("echo after the end")


def test_command_reward_runs_the_tests_in_the_final_sandbox(make_env):
    env = make_env(checkpoint_policy="never", reward=CommandReward("test -f /tmp/done"))
    env.reset()
    assert env.step(f"echo {SUBMIT_MARKER}")[1] == 0.0
    env.reset()
    env.step("touch /tmp/done")
    assert env.step(f"echo {SUBMIT_MARKER}")[1] == 1.0


def test_command_timeout_is_an_observation_not_a_failure(make_env):
    env = make_env(checkpoint_policy="never")
    env.reset()
    obs, _r, terminated, _tr, info = env.step_command("sleep 5", timeout=0.5)
    assert info.get("timed_out") and "rollback" not in info["belayer"] and not terminated
    assert "timed out" in obs


def test_max_steps_truncates(make_env):
    from belayer_env.env.recoverable import EnvConfig

    env = make_env(config=EnvConfig(max_steps=2), checkpoint_policy="never")
    env.reset()
    assert env.step("true")[3] is False
    assert env.step("true")[3] is True


def test_bad_action_is_a_usage_error(make_env):
    env = make_env(checkpoint_policy="never")
    env.reset()
    with pytest.raises(UsageError):
        env.step(["ls"])  # type: ignore[arg-type]


def test_close_removes_containers_and_checkpoints(make_env, docker_client):
    import os

    env = make_env(checkpoint_policy="always")
    env.reset()
    env.step("echo 1 > /f")
    env.settle()
    assert env.checkpointer.ready, "the always policy took no checkpoint"
    directory, name = env.checkpointer.directory, env.name
    env.close()
    env.close()  # idempotent
    assert not containers_of(docker_client, name)
    assert not os.path.exists(directory)
