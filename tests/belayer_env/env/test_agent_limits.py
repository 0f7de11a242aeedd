"""The agent's own limits are its observations, never rollbacks (issue 36, item 7): an action
that fills the sandbox's pids limit, or whose process is killed at its memory limit, comes back
as that action's error text and exit code, however often it is repeated; the agent can clean
up; a checkpoint taken there is ready and the next action works. Real containers, real limits.
"""

from __future__ import annotations

FILL = "for i in $(seq 100); do sleep 1000 & done; echo started"
RUNTIME_TEXT = ("OCI runtime", "init-p", "exec failed", "SandboxLost", "Traceback")


def _failures(env) -> list:
    """Infra events of the trajectory (a checkpoint made ready is none)."""
    return [e for e in env.trajectory.events if e.kind not in ("checkpoint_ready", "standby_preparing")]


def _agent_outcome(env, action: str) -> tuple[str, dict]:
    obs, _reward, terminated, truncated, info = env.step(action)
    assert "rollback" not in info["belayer"] and "recovered_while_idle" not in info["belayer"], info
    assert not terminated and not truncated
    assert not any(t in obs for t in RUNTIME_TEXT), obs
    return obs, info


def test_an_action_past_the_pids_limit_is_the_agents_observation(make_env):
    env = make_env(pids_limit=64, checkpoint_policy="never")
    env.reset(options={"task": "fill the process table"})
    for k in (1, 2):  # repeated: the same outcome, never a loop of rollbacks
        obs, info = _agent_outcome(env, FILL)
        assert info["belayer"]["step"] == k and info["returncode"] != 0, (obs, info)
        assert "fork" in obs and "Resource temporarily unavailable" in obs, obs
        assert "limit of 64 processes" in obs, obs
    # the agent sees the limit and ends what holds it
    obs, info = _agent_outcome(env, "pkill sleep")
    assert info["returncode"] == 0, obs
    obs, info = _agent_outcome(env, "echo clean")
    assert info["returncode"] == 0 and "clean" in obs, obs
    assert _failures(env) == [], env.trajectory.events
    assert [s.step for s in env.trajectory.steps] == [1, 2, 3, 4]


def test_a_checkpoint_at_the_pids_limit_is_ready_and_the_next_action_works(make_env):
    env = make_env(pids_limit=64, checkpoint_policy="always")
    env.reset()
    obs, info = _agent_outcome(env, FILL)
    assert "Resource temporarily unavailable" in obs, obs
    env.settle()
    assert 1 in [c.step for c in env.checkpointer.store.list(env.name)], "boundary 1 is ready"
    obs, info = _agent_outcome(env, "echo after the checkpoint")
    assert info["returncode"] == 0 and "after the checkpoint" in obs, obs
    env.settle()
    assert _failures(env) == [], env.trajectory.events


def test_a_process_killed_at_the_memory_limit_is_the_agents_observation(make_env):
    env = make_env(memory="64m", checkpoint_policy="never")
    env.reset()
    for k in (1, 2):
        obs, info = _agent_outcome(env, "python3 -c 'b = bytearray(512 * 2**20)'")
        assert info["belayer"]["step"] == k and info["returncode"] == 137, (obs, info)
        assert "exceeding the memory limit (64m)" in obs, obs
    obs, info = _agent_outcome(env, "echo still here")
    assert info["returncode"] == 0 and "still here" in obs
    assert _failures(env) == [], env.trajectory.events


def test_a_dead_container_at_the_pids_limit_stays_infrastructure(make_env):
    """The limit does not blur the line: the container killed after a full step is rolled back
    (to the checkpoint taken at the limit), and the restored sandbox runs the agent's next action."""
    from belayer_env.faults.inject import kill_container

    env = make_env(pids_limit=64, checkpoint_policy="always")
    env.reset()
    _agent_outcome(env, FILL)
    env.settle()
    kill_container(env.client, env.sandbox.container_id)
    obs, _r, _t, _tr, info = env.step("echo never shown")
    assert info["belayer"]["rollback"] == {"to_step": 1, "reason": "SandboxLost"}, info
    assert "Resource temporarily unavailable" in obs, obs  # boundary 1's observation again
    obs, info = _agent_outcome(env, "pkill sleep")
    assert info["returncode"] == 0, obs
    obs, info = _agent_outcome(env, "echo clean")
    assert info["returncode"] == 0 and "clean" in obs, obs
    assert [e.kind for e in _failures(env)] == ["rollback"]
