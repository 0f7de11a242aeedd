"""The SkyRL adapter against the real skyrl-gym 0.4 (installed by scripts/setup_skyrl.sh),
driven the way SkyRL's generator drives an env, over real containers and a real kill.

The loop below follows skyrl-train's ``SkyRLGymGenerator.agent_loop``
(skyrl-train/skyrl_train/generators/skyrl_gym_generator.py): ``env =
skyrl_gym.make(env_class, env_config=env_config, extras=env_extras)``; ``chat_history, _ =
env.init(chat_history)``; per turn ``env_step_output = env.step(output)`` reading
``["observations"]``, ``["reward"]``, ``["done"]`` and ``.get("postprocessed_action")``;
at the end ``env.get_metrics()`` and ``env.close()``. Where skyrl-gym is missing every test
fails with the set-up command (never skips).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

try:
    import skyrl_gym
    from omegaconf import OmegaConf
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    MISSING = None
except ImportError as e:  # pragma: no cover - depends on the machine's set-up
    MISSING = f"skyrl-gym is not importable ({e}): run `bash scripts/setup_skyrl.sh` (part of scripts/setup.sh)"

from belayer_env.faults import kill_container
from tests.belayer.wrappers.episodes import failing_fresh_sandboxes
from tests.belayer_env.conftest_env import assert_no_infra_text, containers_of

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def require_skyrl_gym() -> None:
    if MISSING is not None:
        pytest.fail(MISSING, pytrace=False)


@pytest.fixture
def skyrl_env(docker_client):
    """``skyrl_env(env_config, extras)`` -> the env as SkyRL makes it; closed and checked."""
    require_skyrl_gym()
    from belayer.wrappers.skyrl import register

    env_id = register()
    made = []

    def make(env_config, extras):
        env = skyrl_gym.make(env_id, env_config=env_config, extras=extras)
        made.append(env)
        return env

    yield make
    for env in made:
        env.close()
        assert not containers_of(docker_client, env.env.name), "the env left containers behind"


def reply(command: str) -> str:
    return f"I will run it.\n```bash\n{command}\n```"


def test_a_skyrl_gym_env_made_by_skyrl_gym_make(skyrl_env):
    # SkyRL passes its per-env config as an omegaconf DictConfig and the dataset row's extras
    env = skyrl_env(OmegaConf.create({"checkpoint_policy": "never", "sandbox": {"cwd": "/tmp"}}),
                    {"reward_spec": {"test_command": "grep -qx 42 /tmp/answer"},
                     "extra_info": {"setup": "echo 41 > /tmp/answer"},
                     "max_turns": 5})
    assert isinstance(env, skyrl_gym.Env) and isinstance(env, BaseTextEnv)
    prompt = [{"role": "system", "content": "You run shell commands."},
              {"role": "user", "content": "Make /tmp/answer say 42, then submit."}]
    chat_history, _ = env.init(list(prompt))
    assert chat_history == prompt and env.max_turns == 5

    out = env.step(reply("cat answer"))
    assert set(out) == {"observations", "reward", "done", "metadata", "postprocessed_action"}
    assert out["observations"] == [{"role": "user",
                                    "content": "<returncode>0</returncode>\n<output>\n41\n</output>"}]
    assert out["reward"] == 0.0 and out["done"] is False and out["postprocessed_action"] is None
    assert out["metadata"]["belayer"] == {"step": 1} and out["metadata"]["returncode"] == 0
    assert env.step(reply("echo 42 > answer"))["done"] is False
    out = env.step(reply(SUBMIT))
    assert out["done"] is True and out["reward"] == 1.0 and out["observations"] == []
    assert env.get_metrics() == {"steps": 3, "env_rollbacks": 0, "recovered": 0, "fresh_sandbox_retries": 0}


def test_a_rollback_is_in_the_metadata_never_in_an_observation(skyrl_env, docker_client):
    """A real SIGKILL of the container before turn 3's command: the env restores boundary 2
    (checkpointed after turn 2), the step dict says so in its metadata with no observation,
    and a generator that keeps the first ``to_step`` turns regenerates turn 3 from a context
    that matches the sandbox: every effect lands exactly once."""
    env = skyrl_env({"checkpoint_policy": "always"}, {"max_turns": 10})
    chat_history, _ = env.init([{"role": "user", "content": "append 1, 2, 3 to /log and submit it"}])
    turns: list[tuple[str, list]] = []  # (model output, observations) per kept turn
    script = iter([reply("echo 1 >> /log"), reply("echo 2 >> /log"), "KILL", reply("echo 3 >> /log"),
                   reply(f"{SUBMIT} && cat /log")])
    rollbacks = []
    done, out = False, None
    while not done:
        action = next(script)
        if action == "KILL":  # the sandbox dies while the model writes turn 3
            env.env.settle()  # bounded: boundary 2's capture runs during the "generation"
            assert [c.step for c in env.env.checkpointer.ready][-1] == 2
            kill_container(docker_client, env.env.sandbox.container_id)
            action = reply("echo 3 >> /log")
        out = env.step(action)
        for message in out["observations"]:
            assert_no_infra_text(message["content"])
        if "rollback" in out["metadata"]["belayer"]:
            rollbacks.append(out["metadata"]["belayer"]["rollback"])
            assert out["observations"] == [] and out["done"] is False and out["reward"] == 0.0
            del turns[out["metadata"]["belayer"]["rollback"]["to_step"]:]  # cut, then regenerate
            continue
        turns.append((action, out["observations"]))
        done = out["done"]
    assert rollbacks == [{"to_step": 2, "reason": "SandboxLost"}]
    assert out["metadata"]["submission"] == "1\n2\n3\n"
    assert [a for a, _ in turns] == [reply("echo 1 >> /log"), reply("echo 2 >> /log"),
                                     reply("echo 3 >> /log"), reply(f"{SUBMIT} && cat /log")]
    assert [s.action for s in env.env.trajectory.steps] == [
        "echo 1 >> /log", "echo 2 >> /log", "echo 3 >> /log", f"{SUBMIT} && cat /log"]
    assert env.get_metrics() == {"steps": 4, "env_rollbacks": 1, "recovered": 1, "fresh_sandbox_retries": 0}


def test_skyrl_gym_is_imported_lazily():
    """The adapter module imports without skyrl-gym; the env class asks for it by name."""
    code = ("import sys; sys.modules['skyrl_gym'] = None\n"
            "import belayer.wrappers.skyrl as m\n"
            "try:\n    m.RecoverableSkyRLEnv\nexcept ImportError as e:\n    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError: belayer.wrappers.skyrl needs skyrl-gym" in out.stdout
    assert "scripts/setup_skyrl.sh" in out.stdout


def test_beyond_recovery_the_sample_restarts_in_a_fresh_sandbox(skyrl_env, docker_client):
    """No checkpoints, one recovery attempt, boundary 0's restore failing, the container
    SIGKILLed: the infrastructure policy starts a fresh sandbox and ``step`` reports a rollback
    to 0 (no observation); the generator keeps no turn, regenerates, and the sample completes
    with each effect once."""
    env = skyrl_env({"checkpoint_policy": "never", "recovery_attempts": 1}, {"max_turns": 5})
    env.init([{"role": "user", "content": "t"}])
    assert env.step(reply("echo 1 >> /log"))["observations"]
    failing_fresh_sandboxes(env, 1)  # the env's one restore attempt
    kill_container(docker_client, env.env.sandbox.container_id)
    out = env.step(reply("echo 2 >> /log"))
    assert out["observations"] == [] and out["done"] is False and out["reward"] == 0.0
    rollback = out["metadata"]["belayer"]["rollback"]
    assert rollback["to_step"] == 0 and rollback["fresh_sandbox"] == 1, rollback
    env.step(reply("echo 1 >> /log"))
    out = env.step(reply(f"{SUBMIT} && cat /log"))
    assert out["done"] is True and out["metadata"]["submission"] == "1\n"
    assert env.get_metrics()["fresh_sandbox_retries"] == 1


def test_exhausted_recovery_raises_never_an_observation(skyrl_env, docker_client):
    """No checkpoints, one recovery attempt, and every fresh sandbox failing as it is created:
    past the policy's retries ``step`` raises ``SampleDropped`` (an ``InfraError``: no sample,
    never reward 0) instead of returning a step dict."""
    from belayer.wrappers.infra_policy import SampleDropped

    env = skyrl_env({"checkpoint_policy": "never", "recovery_attempts": 1, "infra": {"retries": 1}},
                    {"max_turns": 5})
    env.init([{"role": "user", "content": "t"}])
    assert env.step(reply("echo 1 >> /log"))["observations"]
    failing_fresh_sandboxes(env, None)
    kill_container(docker_client, env.env.sandbox.container_id)
    with pytest.raises(SampleDropped) as dropped:
        env.step(reply("echo 2 >> /log"))
    assert len(dropped.value.attempts) == 2  # the sandbox, then its one fresh replacement
