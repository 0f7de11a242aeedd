"""Prefix-consistent recovery with real faults: rollback, fencing, no replay, no infra text."""

from __future__ import annotations

import os

from belayer_env.env.policy import AlwaysPolicy
from belayer_env.faults.inject import (
    TransportBreaker,
    kill_container,
    kill_processes,
    oom_container,
)
from belayer_env.restore.prestaging import discard_copies
from belayer_env.sandbox.treehash import tree_hash
from tests.belayer_env.conftest_checkpoint import init_pid
from tests.belayer_env.conftest_env import assert_no_infra_text
from tests.conftest import process_alive, wait_until

COUNTER_PY = """
import signal, time
n = 0
def inc(*_):
    global n
    n += 1
    with open("/tmp/n", "w") as f:
        f.write(str(n))
signal.signal(signal.SIGUSR1, inc)
while True:
    time.sleep(1)
"""
# a background process whose only state is in memory: USR1 increments it, /tmp/n shows it
COUNTER = (f"cat > /opt/c.py <<'EOF'\n{COUNTER_PY}\nEOF\n"
           "setsid nohup python3 /opt/c.py >/dev/null 2>&1 </dev/null & echo $! > /tmp/pid; sleep 0.3")
BUMP = "kill -USR1 $(cat /tmp/pid); for i in $(seq 100); do [ \"$(cat /tmp/n 2>/dev/null)\" = {n} ] && break; sleep 0.02; done; cat /tmp/n"


def test_failure_rolls_back_to_initial_state_without_checkpoints(make_env, docker_client):
    env = make_env(checkpoint_policy="never")
    task, _ = env.reset(options={"task": "the task", "setup": "echo base > /base"})
    env.step("echo one > /one")
    env.step("echo two > /two")
    kill_container(docker_client, env.sandbox.container_id)
    obs, reward, terminated, truncated, info = env.step("echo three > /three")
    assert info["belayer"]["rollback"] == {"to_step": 0, "reason": "SandboxLost"}
    assert obs == task and reward == 0.0 and not terminated and not truncated
    assert_no_infra_text(obs)
    # boundary 0 again: setup applied, no effect of steps 1..3
    out = env.step("ls /base /one /two /three 2>&1; cat /base")[0]
    assert "\nbase\n" in out and "'/one': No such file" in out and "'/three': No such file" in out
    traj = env.trajectory
    assert [e.kind for e in traj.events if e.kind == "rollback"] == ["rollback"]
    rb = next(e for e in traj.events if e.kind == "rollback")
    assert rb.at_step == 2 and rb.discarded_steps == 2 and rb.error == "SandboxLost" and rb.message
    assert traj.steps[-1].regenerated and len(traj.steps) == 1


def test_failure_rolls_back_to_newest_checkpoint_with_runtime_state(make_env, docker_client):
    env = make_env(checkpoint_policy="always")
    env.reset()
    env.step(COUNTER)
    env.step(BUMP.format(n=1))
    obs3 = env.step("echo kept > /kept; " + BUMP.format(n=2))[0]
    env.settle()
    assert env.checkpointer.ready[-1].step == 3
    hash3 = tree_hash(env.sandbox, "/")
    kill_container(docker_client, env.sandbox.container_id)
    obs, _r, _te, _tr, info = env.step("echo lost > /lost; " + BUMP.format(n=3))
    assert info["belayer"]["rollback"] == {"to_step": 3, "reason": "SandboxLost"}
    assert obs == obs3  # the agent's context ends where the sandbox now is
    assert_no_infra_text(obs)
    assert tree_hash(env.sandbox, "/") == hash3
    # the in-memory counter continues from boundary 3 (2): the failed bump was not applied
    out = env.step(BUMP.format(n=3) + "; ls /kept /lost 2>&1")[0]
    assert "<output>\n3" in out and "'/lost': No such file" in out and "/kept" in out, out


def test_checkpoint_j_not_initial_and_action_not_replayed(make_env, docker_client):
    env = make_env(checkpoint_policy="always")
    env.reset()
    env.step("echo a >> /log")
    env.step("echo b >> /log")
    env.settle()
    kill_container(docker_client, env.sandbox.container_id)
    obs, _r, _te, _tr, info = env.step("echo c >> /log")
    assert info["belayer"]["rollback"]["to_step"] == 2
    assert obs == env.trajectory.steps[-1].observation and len(env.trajectory.steps) == 2
    assert env.step("cat /log")[0].endswith("<output>\na\nb\n</output>")


def test_broken_exec_transport_fences_the_old_container(make_env, docker_client):
    env = make_env(checkpoint_policy="never")
    breaker = TransportBreaker(env.client)
    env.reset()
    old = env.sandbox.container_id
    import threading

    # cut the stream while the command runs; the command would write /late later
    timer = threading.Timer(0.5, breaker.break_all)
    timer.start()
    obs, _r, _te, _tr, info = env.step("sleep 4; echo late > /late")
    timer.join()
    assert info["belayer"]["rollback"]["to_step"] == 0
    assert_no_infra_text(obs)
    assert old != env.sandbox.container_id
    assert not docker_client.api.containers(all=True, filters={"id": old}), "old container not fenced"
    assert "No such file" in env.step("sleep 4; cat /late 2>&1")[0]


def test_stream_cut_at_exec_start_is_not_an_agent_outcome(make_env):
    """The sandbox reports a cut stream as SandboxLost (never Docker's bare 126): rolled back."""
    env = make_env(checkpoint_policy="never")
    breaker = TransportBreaker(env.client)
    env.reset()
    breaker.cut_next()
    obs, _r, _te, _tr, info = env.step("echo effect > /effect")
    assert info["belayer"]["rollback"]["to_step"] == 0
    assert "No such file" in env.step("cat /effect 2>&1")[0]


def test_a_command_that_exits_126_silently_is_the_agents_outcome(make_env):
    """Exit 126 with no output is what the command did (the sandbox tells a failed exec apart
    itself): returned to the agent, not rolled back."""
    env = make_env(checkpoint_policy="never")
    env.reset()
    env.step("echo kept > /kept")
    obs, _r, _te, _tr, info = env.step("exit 126")
    assert "rollback" not in info["belayer"], info
    assert "126" in obs, obs
    assert env.step("cat /kept")[0].endswith("<output>\nkept\n</output>")


def test_oom_and_killed_processes_are_infra_failures(make_env, docker_client):
    env = make_env(checkpoint_policy="never", memory="256m")
    env.reset()
    for fault in (oom_container, kill_processes):
        env.step("echo x > /x")
        fault(docker_client, env.sandbox.container_id)
        wait_until(lambda: not env.sandbox.is_alive(), 20, f"{fault.__name__} to take the container down")
        obs, _r, _te, _tr, info = env.step("cat /x")
        assert info["belayer"]["rollback"]["to_step"] == 0, fault.__name__
        assert_no_infra_text(obs)


def test_corrupt_newest_checkpoint_falls_back_to_an_older_one(make_env, docker_client):
    env = make_env(checkpoint_policy=AlwaysPolicy())
    env.reset()
    env.step("echo 1 > /one")
    env.settle()
    env.step("echo 2 > /two")
    env.settle()
    newest = env.checkpointer.ready[-1]
    assert newest.step == 2
    # The corruption must be what the restore reads. A copy pre-staged (and verified) before
    # the bytes flip would restore boundary 2 intact; that race went either way under load
    # (seen in a CI rehearsal). So let the pre-staging end, drop its copy, then corrupt.
    staging = [p for p in env.checkpointer._prestaging if p.checkpoint is not None and p.checkpoint.id == newest.id]
    assert all(p.prestaged.wait(120) for p in staging), "boundary 2's pre-staging did not end within 120 s"
    discard_copies(docker_client, newest.id)
    biggest = max((os.path.join(d, f) for d, _, fs in os.walk(newest.path) for f in fs), key=os.path.getsize)
    with open(biggest, "r+b") as f:  # flip bytes in the middle: checksums must catch it
        f.seek(os.path.getsize(biggest) // 2)
        f.write(b"\xff" * 64)
    kill_container(docker_client, env.sandbox.container_id)
    _obs, _r, _te, _tr, info = env.step("true")
    assert info["belayer"]["rollback"]["to_step"] == 1
    assert any(e.kind == "restore_failed" for e in env.trajectory.events)
    assert "No such file" in env.step("cat /one; cat /two 2>&1")[0]


def test_capture_runs_in_the_background(make_env):
    env = make_env(checkpoint_policy="always")
    env.reset()
    env.step("head -c 20000000 /dev/urandom > /blob")  # a capture with something to write
    pending = env.checkpointer._pending
    assert pending is not None and not pending.done(), "step() waited for the capture"
    env.settle()
    assert env.checkpointer.ready and env.checkpointer.ready[-1].step == 1


def test_container_killed_mid_dump_is_fenced_and_restored(make_env, docker_client, criu_hold):
    """The container dies while CRIU dumps it (CRIU held stopped with its processes seized, as
    a hung dump): the env kills the dump, fences the container under its own name and
    restores boundary 1."""
    env = make_env(checkpoint_policy="always")
    env.reset()
    name = env.name
    env.step("echo a >> /log")
    env.settle()
    assert [c.step for c in env.checkpointer.ready] == [1]
    hold = criu_hold()
    sandbox = env.sandbox
    env.step("echo b >> /log")  # its capture is the one held mid-dump
    pending = env.checkpointer._pending
    assert pending is not None, "boundary 2 is not being captured"
    criu_pid = hold.wait(init_pid(sandbox), dumping=lambda: not pending.done())
    kill_container(docker_client, sandbox.container_id)
    obs, _r, _te, _tr, info = env.step("echo c >> /log")
    assert info["belayer"]["rollback"] == {"to_step": 1, "reason": "SandboxLost"}, info
    assert_no_infra_text(obs)
    assert env.name == name, "restored under a fresh name: the old container could not be fenced"
    wait_until(lambda: not process_alive(criu_pid), 30, f"the stopped criu {criu_pid} killed and reaped")
    assert env.step("cat /log")[0].endswith("<output>\na\n</output>")
    assert "checkpoint_abandoned" in [e.kind for e in env.trajectory.events]
