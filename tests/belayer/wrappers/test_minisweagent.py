"""The mini-swe-agent adapter, checked against its documented interface by duck typing.

mini-swe-agent itself is not a dependency (it pulls litellm); ``ScriptedAgent`` below
follows DefaultAgent's control flow: append the model's message, execute its actions,
append observations, and on an ``InterruptAgentFlow``-like exception append its messages.
"""

from __future__ import annotations

import pytest

from belayer.wrappers.minisweagent import (
    RecoverableDockerEnvironmentConfig,
    RolledBack,
)
from belayer_env.faults.inject import kill_container

# DockerEnvironmentConfig's fields in mini-swe-agent 2.x (src/minisweagent/environments/docker.py)
MSWEA_FIELDS = {"image", "cwd", "env", "forward_env", "timeout", "executable", "run_args",
                "container_timeout", "pull_timeout", "interpreter"}


class ScriptedAgent:
    def __init__(self, env, replies: list[list[str]]):
        self.env, self.replies, self.messages = env, list(replies), [
            {"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
        self.rollbacks: list[int] = []

    def step(self) -> None:
        actions = self.replies[len([m for m in self.messages if m["role"] == "assistant"])]
        self.messages.append({"role": "assistant", "content": "...",
                              "extra": {"actions": [{"command": a} for a in actions]}})
        try:
            outputs = [self.env.execute(a) for a in self.messages[-1]["extra"]["actions"]]
        except RolledBack as e:
            self.rollbacks.append(e.to_step)
            self.messages.extend(e.messages)
            return
        self.messages.extend({"role": "user", "content": o["output"]} for o in outputs)



def test_config_has_mini_swe_agent_fields():
    assert set(RecoverableDockerEnvironmentConfig.model_fields) >= MSWEA_FIELDS


def test_execute_template_vars_serialize(msw_env, monkeypatch):
    monkeypatch.setenv("BELAYER_TEST_FWD", "forwarded")
    env = msw_env(cwd="/tmp", env={"A": "1"}, forward_env=["BELAYER_TEST_FWD"], timeout=5)
    out = env.execute({"command": "pwd; echo $A $BELAYER_TEST_FWD; exit 3"})
    assert out == {"output": "/tmp\n1 forwarded\n", "returncode": 3, "exception_info": ""}
    assert env.execute("echo str-action")["output"] == "str-action\n"  # v1 style
    assert env.execute({"command": "pwd"}, cwd="/")["output"] == "/\n"
    tv = env.get_template_vars(extra=1)
    assert tv["image"] == "belayer-base:latest" and tv["cwd"] == "/tmp" and tv["extra"] == 1 and "system" in tv
    ser = env.serialize()["info"]
    assert ser["config"]["environment_type"] == "belayer.wrappers.minisweagent.RecoverableDockerEnvironment"
    assert ser["config"]["environment"]["image"] == "belayer-base:latest" and ser["belayer"]["recovered"] is False


def test_submit_returns_output_or_raises_submitted(msw_env):
    """v1's ``execute(command: str)`` returns the submission's output; v2's dict action raises
    mini-swe-agent's ``Submitted`` where it is installed (set-up installs it: its venv is on
    the path, tests/belayer/wrappers/conftest.py), else returns the output too."""
    from belayer.wrappers import minisweagent

    submit = "printf 'COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\\npatch'"
    out = msw_env().execute(submit)
    assert out["returncode"] == 0 and out["output"].endswith("patch")
    env = msw_env()
    if minisweagent._Submitted is None:
        out = env.execute({"command": submit})
        assert out["returncode"] == 0 and out["output"].endswith("patch")
    else:
        with pytest.raises(minisweagent._Submitted):
            env.execute({"command": submit})


def test_rollback_truncates_the_agent_messages(msw_env, docker_client):
    env = msw_env(checkpoint_policy="always")
    agent = ScriptedAgent(env, [["echo a >> /log"], ["echo b >> /log", "echo c >> /log"], ["echo d >> /log"],
                                ["cat /log"]])
    env.bind(agent)
    agent.step()
    agent.step()  # two actions in one message: only the boundary after both is checkpointed
    env.env.settle()
    assert [c.step for c in env.env.checkpointer.ready] == [1, 3]
    before = [dict(m) for m in agent.messages]
    kill_container(docker_client, env.container_id)
    agent.step()  # "echo d" hits the dead sandbox
    assert agent.rollbacks == [3]
    assert agent.messages == before  # cut back to boundary 3: the failed message is gone
    agent.step()  # regenerated: the model is asked again with the same context
    agent.step()
    assert agent.messages[-1]["content"] == "a\nb\nc\nd\n"
    assert env.serialize()["info"]["belayer"]["recovered"] is True
