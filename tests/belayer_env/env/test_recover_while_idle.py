"""``EnvConfig.recover_while_idle``: a sandbox killed while the agent generates is restored
in the background; the next step runs its action on the restored sandbox (same boundary),
or returns the rollback (an older one), never replaying an action that ran."""

from __future__ import annotations

from belayer_env.faults.inject import kill_container
from belayer_env.sandbox.treehash import tree_hash
from tests.belayer_env.conftest_env import assert_no_infra_text
from tests.belayer_env.env.test_env_recovery import BUMP, COUNTER
from tests.conftest import wait_until

RESTORE_WAIT_S = 120


def _idle_rollbacks(env) -> list:
    return [e for e in env.trajectory.events if e.kind == "rollback" and e.while_idle]


def _wait_restored(env, n: int = 1) -> None:
    wait_until(lambda: len(_idle_rollbacks(env)) >= n, RESTORE_WAIT_S,
               f"restore #{n} of the sandbox killed while idle (events: {[e.kind for e in env.trajectory.events]})")


def test_killed_while_idle_then_the_next_action_runs_once_on_the_restored_boundary(make_env, docker_client):
    env = make_env(checkpoint_policy="always", recover_while_idle=True)
    env.reset()
    env.step(COUNTER)
    env.step(BUMP.format(n=1))
    env.step("echo kept > /kept; " + BUMP.format(n=2))
    env.settle()
    hash3, dead = tree_hash(env.sandbox, "/"), env.sandbox.container_id
    kill_container(docker_client, dead)
    _wait_restored(env)  # before the agent's next call: the restore is not on its path
    assert env.sandbox.container_id != dead
    assert tree_hash(env.sandbox, "/") == hash3
    obs, _r, _te, _tr, info = env.step(BUMP.format(n=3) + "; ls /kept")
    # the counter lives in memory: 3 means boundary 3's process state came back and this
    # action ran exactly once, on it
    assert "<output>\n3/kept\n" in obs, obs
    assert_no_infra_text(obs)
    assert "rollback" not in info["belayer"]
    assert info["belayer"]["recovered_while_idle"] == {"to_step": 3, "reason": "SandboxLost"}
    assert len(env.trajectory.steps) == 4
    event = _idle_rollbacks(env)[0]
    assert event.at_step == 3 and event.to_step == 3 and event.discarded_steps == 0
    assert event.waited_s is not None and event.waited_s >= 0
    assert {"fence", "wait_capture", "restore"} <= set(event.recovery_parts)  # where the recovery went
    assert sum(event.recovery_parts.values()) <= event.recovery_s + 1e-3
    env.reset()  # its own fence of the old sandbox is not a death to recover from
    env.step("true")
    assert not _idle_rollbacks(env)


def test_killed_while_idle_without_a_checkpoint_returns_the_rollback_and_runs_nothing(make_env, docker_client):
    env = make_env(checkpoint_policy="never", recover_while_idle=True)
    task, _ = env.reset(options={"task": "the task", "setup": "echo base > /base"})
    env.step("echo one > /one")
    kill_container(docker_client, env.sandbox.container_id)
    _wait_restored(env)
    obs, _r, terminated, _tr, info = env.step("echo two > /two")
    assert info["belayer"]["rollback"] == {"to_step": 0, "reason": "SandboxLost"}
    assert info["belayer"]["recovered_while_idle"] == info["belayer"]["rollback"]
    assert obs == task and not terminated
    out = env.step("cat /base; ls /one /two 2>&1")[0]
    assert "\nbase\n" in out and "'/one': No such" in out and "'/two': No such" in out, out
    assert [s.action for s in env.trajectory.steps] == ["cat /base; ls /one /two 2>&1"]


def test_a_kill_racing_the_next_step_is_recovered_once_either_way(make_env, docker_client):
    """The kill lands just before the step: the watch or the step sees it first. Whichever
    does, one rollback, and the log holds each committed step's line exactly once."""
    env = make_env(checkpoint_policy="always", recover_while_idle=True)
    env.reset()
    for i in range(4):
        env.step(f"echo {i} >> /log")
        env.settle()
        kill_container(docker_client, env.sandbox.container_id)
        obs, _r, _te, _tr, info = env.step(f"echo {i}b >> /log")
        assert_no_infra_text(obs)
        if "rollback" in info["belayer"]:  # the step found it dead: the agent regenerates
            assert info["belayer"]["rollback"]["to_step"] == len(env.trajectory.steps)
            env.step(f"echo {i}b >> /log")
    rollbacks = [e for e in env.trajectory.events if e.kind == "rollback"]
    assert len(rollbacks) == 4
    committed = [s.action.split(" ")[1] for s in env.trajectory.steps]
    assert env.step("cat /log")[0].endswith("<output>\n" + "".join(f"{c}\n" for c in committed) + "</output>")


def test_an_init_that_exits_by_itself_while_idle_is_the_next_steps_to_judge(make_env):
    """A background job of an action ends the sandbox from inside: that is the agent's doing,
    so the env does not restore behind its back; the next step sees it as it would without
    the watch (recovered once, then the agent's outcome)."""
    env = make_env(checkpoint_policy="never", recover_while_idle=True)
    env.reset()
    env.step("echo a > /f")
    env.step("(sleep 0.2; kill -TERM 1) >/dev/null 2>&1 &")
    pid = env.sandbox.container_id
    wait_until(lambda: not docker_running(env, pid), 30, "the sandbox's init to exit by itself")
    assert not _idle_rollbacks(env)
    obs, _r, terminated, _tr, info = env.step("cat /f")
    assert info["belayer"]["rollback"] == {"to_step": 0, "reason": "SandboxLost"} and not terminated
    assert "recovered_while_idle" not in info["belayer"]


def docker_running(env, container_id: str) -> bool:
    return bool(env.client.api.inspect_container(container_id)["State"].get("Running"))
