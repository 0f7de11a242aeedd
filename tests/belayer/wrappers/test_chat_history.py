"""ChatHistory: a plain agent loop gets prefix-consistent context by wrapping."""

from __future__ import annotations

from belayer.wrappers.chat_history import ChatHistory, parse_bash_block
from belayer_env.faults.inject import kill_container


def test_parse_bash_block():
    assert parse_bash_block("think\n```bash\nls -la\n```\n") == "ls -la"
    assert parse_bash_block("```bash\na\n```\n```bash\nb\n```") == "b"
    assert parse_bash_block("echo plain") == "echo plain"


def test_messages_follow_steps_and_are_cut_on_rollback(make_env, docker_client):
    env = ChatHistory(make_env(checkpoint_policy="always"), system_prompt="you are an agent")
    env.reset(options={"task": "count"})
    assert [m["role"] for m in env.messages] == ["system", "user"]
    env.step("first\n```bash\necho 1 >> /log\n```")
    env.step("second\n```bash\necho 2 >> /log\n```")
    env.unwrapped.settle()
    at_2 = [dict(m) for m in env.messages]
    env.step("third\n```bash\necho 3 >> /log\n```")
    env.unwrapped.settle()
    kill_container(docker_client, env.unwrapped.sandbox.container_id)
    _obs, _r, _te, _tr, info = env.step("fourth\n```bash\necho 4 >> /log\n```")
    j = info["belayer"]["rollback"]["to_step"]
    assert j == 3 and env.boundary == 3
    assert len(env.messages) == 2 + 2 * 3 and env.messages[: len(at_2)] == at_2
    assert env.messages[-2]["content"].startswith("third")
    # the regenerated step continues from the same context and the same sandbox state
    obs = env.step("again\n```bash\ncat /log\n```")[0]
    assert obs.endswith("<output>\n1\n2\n3\n</output>")
    assert env.messages[-1]["content"] == obs and env.boundary == 4


def test_rollback_to_zero_keeps_system_and_task(make_env, docker_client):
    env = ChatHistory(make_env(checkpoint_policy="never"))
    env.reset(options={"task": "the task"})
    env.step("echo hi")
    kill_container(docker_client, env.unwrapped.sandbox.container_id)
    obs, _r, _te, _tr, info = env.step("echo again")
    assert info["belayer"]["rollback"]["to_step"] == 0
    assert env.messages == [{"role": "user", "content": "the task"}] and obs == "the task"
