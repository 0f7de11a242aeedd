"""The mini-swe-agent adapter under the REAL mini-swe-agent (2.x): ``DefaultAgent.run``
(and ``InteractiveAgent``, the ``mini`` CLI's agent, in yolo mode) with its scripted
``DeterministicModel``, a real container and a real SIGKILL mid-run.

mini-swe-agent (it pulls litellm) lives in its own venv, installed by
``scripts/setup_minisweagent.sh`` (part of ``scripts/setup.sh``); ``extra_deps`` puts it on
this interpreter's path after the project's packages. Where it is missing every test here
fails with that hint: these tests never skip.
"""

from __future__ import annotations

import threading

import pytest

from tests.belayer.wrappers.extra_deps import add_minisweagent_venv

MISSING = add_minisweagent_venv()  # None when mini-swe-agent imports

if MISSING is None:  # else every test fails (the fixture below), naming the set-up command
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.agents.interactive import InteractiveAgent
    from minisweagent.exceptions import InterruptAgentFlow
    from minisweagent.models.test_models import DeterministicModel, make_output

    from belayer.wrappers.minisweagent import RolledBack
    from belayer_env.faults import kill_container
    from tests.belayer.wrappers.episodes import failing_fresh_sandboxes
    from tests.belayer_env.conftest_env import assert_no_infra_text
    from tests.conftest import wait_until

    class HookedModel(DeterministicModel):
        """mini-swe-agent's scripted model, plus a record of every prompt and per-call hooks
        (a hook runs while the "LLM" generates, as a slow model would)."""

        def __init__(self, hooks: dict | None = None, **kwargs):
            super().__init__(**kwargs)
            self.hooks, self.prompts = hooks or {}, []

        def query(self, messages, **kwargs):
            self.prompts.append(list(messages))
            if hook := self.hooks.get(len(self.prompts) - 1):
                hook()
            return super().query(messages, **kwargs)

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /log"


def require_minisweagent() -> None:
    """First line of every test: a missing mini-swe-agent is a failure, never a skip."""
    if MISSING is not None:
        pytest.fail(MISSING, pytrace=False)


def test_rolled_back_is_an_interrupt_agent_flow():
    require_minisweagent()
    assert issubclass(RolledBack, InterruptAgentFlow)
    assert RolledBack(3, "SandboxLost").messages == ()


def make_agent(agent_class: str, model, env, monkeypatch):
    kw = dict(system_template="You run shell commands.", instance_template="Task: {{task}}",
              step_limit=10, cost_limit=0.0)
    if agent_class == "default":
        return DefaultAgent(model, env, **kw)
    # what `mini --yolo --exit-immediately` builds: no confirmation of actions nor of the exit
    agent = InteractiveAgent(model, env, mode="yolo", confirm_exit=False, **kw)

    def no_prompt(*a, **k):
        raise AssertionError(f"InteractiveAgent prompted the user: {a}")

    monkeypatch.setattr(agent, "_prompt_and_handle_slash_commands", no_prompt)
    return agent


@pytest.mark.parametrize(("agent_class", "fault"), [
    ("default", "before_message"), ("default", "mid_message"),
    ("interactive", "before_message"), ("interactive", "mid_message")])
def test_agent_regenerates_after_a_real_sigkill(msw_env, docker_client, monkeypatch, agent_class, fault):
    """Message 2 is lost to a SIGKILL of the container, either before its first action runs
    or after it ran (its effect then dies with the container) while its second one runs.
    The env restores boundary 3 (the end of message 1), the agent's context is cut to
    match, the agent asks the model again, and every effect lands exactly once.

    InteractiveAgent appends the observations of the actions that ran ("echo four", on the
    discarded branch) in a ``finally`` of ``execute_actions``, after the adapter's cut: the
    retry prompt must still be the lost call's prompt, without that stale observation."""
    require_minisweagent()
    env = msw_env(checkpoint_policy="always", timeout=60)
    outputs = [
        make_output("first", [{"command": "echo one >> /log"}], cost=0.0),
        make_output("two at once", [{"command": "echo two >> /log"}, {"command": "echo three >> /log"}], cost=0.0),
        # lost: its second action is long, so the mid-message kill lands while it runs
        make_output("lost", [{"command": "echo four >> /log"}, {"command": "sleep 30; echo five >> /log"}], cost=0.0),
        make_output("regenerated", [{"command": "echo four >> /log"}, {"command": "echo five >> /log"}], cost=0.0),
        make_output("done", [{"command": SUBMIT}], cost=0.0),
    ]
    killer: dict = {}

    def fault_during_generation_of_message_2() -> None:
        env.env.settle()  # bounded: the capture of boundary 3 runs while the "LLM" generates
        assert [c.step for c in env.env.checkpointer.ready] == [1, 3]
        if fault == "before_message":
            kill_container(docker_client, env.container_id)
            return
        # mid-message: once "echo four" is committed (step 4), kill during "sleep 30; ..."
        def kill_after_step_4() -> None:
            try:
                wait_until(lambda: len(env.env.trajectory.steps) >= 4, 25, "step 4 committed")
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                killer["error"] = e
                return
            killer["container"] = env.container_id
            kill_container(docker_client, killer["container"])
        killer["thread"] = threading.Thread(target=kill_after_step_4, daemon=True)
        killer["thread"].start()

    model = HookedModel(outputs=outputs, hooks={2: fault_during_generation_of_message_2})
    agent = make_agent(agent_class, model, env, monkeypatch)
    env.bind(agent)

    result = agent.run("append one to five to /log, then submit it")

    if fault == "mid_message":
        killer["thread"].join(timeout=30)
        assert not killer["thread"].is_alive() and "error" not in killer, killer
        assert killer.get("container"), "the kill after step 4 never fired"
    # the run ends normally, with the submission showing each action's effect exactly once
    assert result["exit_status"] == "Submitted", agent.messages[-1]
    assert result["submission"] == "one\ntwo\nthree\nfour\nfive\n"
    # the lost message was regenerated (the model was asked again, with the context of
    # boundary 3), never replayed by the env
    assert model.current_index == len(outputs) - 1 and agent.n_calls == len(outputs)
    assert model.prompts[3] == model.prompts[2]  # no observation of the discarded branch
    assert len(model.prompts[2]) == 7  # system, task, message 0 + 1 observation, message 1 + 2 observations
    assert outputs[2] not in agent.messages and outputs[3] in agent.messages
    # the agent's messages: the prefix up to boundary 3, then the regenerated branch
    roles = [m["role"] for m in agent.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user", "user",
                     "assistant", "user", "user", "assistant", "exit"]
    assert agent.messages[:7] == model.prompts[2]
    assert [m["extra"]["returncode"] for m in agent.messages if m["role"] == "user" and "extra" in m] \
        == [0, 0, 0, 0, 0]
    for m in agent.messages:  # no infra error text (SandboxLost, docker, ...) reaches the agent
        assert_no_infra_text(str(m["content"]))
        assert not (m.get("extra") or {}).get("exception_info")
    # Belayer's record: one rollback, to boundary 3, of the step the fault hit
    belayer = env.serialize()["info"]["belayer"]
    assert belayer["recovered"] is True
    rollbacks = [e for e in belayer["events"] if e["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 3, rollbacks
    assert rollbacks[0]["at_step"] == (3 if fault == "before_message" else 4), rollbacks
    assert [s.action for s in env.env.trajectory.steps] == [
        "echo one >> /log", "echo two >> /log", "echo three >> /log", "echo four >> /log",
        "echo five >> /log", SUBMIT]
    # the whole trajectory still serializes the mini-swe-agent way
    saved = agent.serialize()
    assert saved["info"]["exit_status"] == "Submitted"
    assert saved["info"]["config"]["environment_type"] == "belayer.wrappers.minisweagent.RecoverableDockerEnvironment"


def run_with_sandbox_lost(env, docker_client, outputs: list, fail_restores: int | None):
    """mini-swe-agent's ``DefaultAgent`` on ``outputs``; the container is SIGKILLed while the model
    writes message 2 and the creation of fresh sandboxes fails ``fail_restores`` times (None: always)."""
    def beyond_recovery() -> None:
        failing_fresh_sandboxes(env, fail_restores)
        kill_container(docker_client, env.container_id)

    model = HookedModel(outputs=outputs, hooks={1: beyond_recovery})
    agent = DefaultAgent(model, env, system_template="You run shell commands.", instance_template="Task: {{task}}",
                         step_limit=10, cost_limit=0.0)
    env.bind(agent)
    return model, agent, agent.run("append one to /log, then submit it")


def test_beyond_recovery_the_run_restarts_in_a_fresh_sandbox(msw_env, docker_client):
    """The container SIGKILLed while the model writes message 2, and every restore the env
    tries fails: the infrastructure policy starts a fresh sandbox, the agent's context goes back
    to its first query (a rollback to 0), and the run ends normally with each effect once."""
    require_minisweagent()
    env = msw_env(checkpoint_policy="never", timeout=60)
    outputs = [make_output("first", [{"command": "echo one >> /log"}], cost=0.0),
               make_output("lost", [{"command": "echo two >> /log"}], cost=0.0),
               make_output("again", [{"command": "echo one >> /log"}], cost=0.0),
               make_output("done", [{"command": SUBMIT}], cost=0.0)]
    # every restore of this sandbox fails; the fresh one the policy starts does not
    model, agent, result = run_with_sandbox_lost(env, docker_client, outputs, env.env.config.recovery_attempts)
    assert result["exit_status"] == "Submitted" and result["submission"] == "one\n", agent.messages[-1]
    assert model.prompts[2] == model.prompts[0], "the agent restarted from its first query"
    belayer = env.serialize()["info"]["belayer"]
    assert belayer["fresh_sandbox_retries"] == 1 and belayer["dropped"] is None, belayer
    for m in agent.messages:
        assert_no_infra_text(str(m["content"]))


def test_past_its_retries_the_run_ends_infra_dropped_without_a_reward(msw_env, docker_client):
    """Every fresh sandbox fails too, one retry allowed: the run ends with ``exit_status``
    "InfraDropped" and no submission (a trainer takes no sample from it), never an observation."""
    require_minisweagent()
    env = msw_env(checkpoint_policy="never", timeout=60, infra={"retries": 1})
    outputs = [make_output("first", [{"command": "echo one >> /log"}], cost=0.0),
               make_output("lost", [{"command": "echo two >> /log"}], cost=0.0)]
    model, agent, result = run_with_sandbox_lost(env, docker_client, outputs, None)
    assert result["exit_status"] == "InfraDropped" and result["submission"] == "", result
    assert len(result["belayer_dropped"]) == 2, result  # the first sandbox, then the one fresh sandbox
    assert set(result["belayer_dropped"]) <= {"RestoreFailed", "SandboxLost", "InjectedFault"}, result
    assert env.serialize()["info"]["belayer"]["dropped"] == result["belayer_dropped"]
    for m in agent.messages[:-1]:
        assert_no_infra_text(str(m["content"]))
