"""The standby sandbox: the newest checkpoint pre-restored, frozen; rollback = fence + thaw + verify.

Real containers and CRIU. The properties: a prepared standby stays frozen (it cannot
diverge); promoting it gives exactly the checkpoint's boundary (memory of a live server, an
unbroken append-only log, no file written after the checkpoint); the failed sandbox is
fenced; faults while preparing or thawing fall back to the usual restore, still consistent.
"""

from __future__ import annotations

import pytest

from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.common.phases import Phase
from belayer_env.env.policy import AdaptivePolicy, AlwaysPolicy, NeverPolicy
from belayer_env.env.recoverable import EnvConfig
from belayer_env.faults.inject import FaultInjector, InjectedFault, kill_container
from belayer_env.ops.gc import list_managed
from belayer_env.restore.standby import Standby
from belayer_env.sandbox import freezer
from belayer_env.sandbox.fence import sandbox_containers
from belayer_env.sandbox.removal import wait_removed
from belayer_env.sandbox.treehash import tree_hash
from tests.belayer_env.conftest_checkpoint import http_get, log_state, start_counter, start_server
from tests.belayer_env.conftest_env import assert_no_infra_text
from tests.belayer_env.env.test_env_recovery import BUMP, COUNTER
from tests.conftest import wait_until

GIB = 1 << 30


def _running(client, name: str) -> list[str]:
    return [c["Id"] for c in sandbox_containers(client, name, by_name=True) if c.get("State") == "running"]


def _processes(container_id: str) -> list[int]:
    """The pids in the container's cgroup (none once it is dead, or its cgroup gone or going);
    a cgroup here that cannot be read is an error, not "none"."""
    found = freezer.procs(container_id)
    if found is None and freezer.control_file(container_id) is not None:
        raise AssertionError(f"the cgroup of {container_id[:12]} is here but its cgroup.procs cannot be read")
    return found or []


def test_standby_is_frozen_and_promotes_to_the_checkpoint(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    start_counter(sb)
    start_server(sb)
    sb.execute("mkdir -p /w && echo one > /w/a && ln -s a /w/l")
    h0 = http_get(sb)
    tree = tree_hash(sb, root="/w")
    ck = full_checkpoint(sb, ck_store, 1)
    standby = Standby(docker_client)
    standby.prepare(ck)
    wait_until(lambda: standby.ready() or standby.error, 120, "standby prepared")
    assert standby.error is None, standby.error
    cid = standby._sandbox.container_id
    # frozen through its cgroup: Docker never paused it, so its thaw needs no Docker call
    assert freezer.is_frozen(cid) and not docker_client.api.inspect_container(cid)["State"]["Paused"]
    managed = {c.id: c for c in list_managed(docker_client)}
    assert cid in managed and not managed[cid].orphaned  # labelled, owned: gc reaps it if we die
    # the live sandbox moves on past the checkpoint, then fails
    assert sb.execute("echo late > /late")["returncode"] == 0
    assert http_get(sb) == h0 + 1
    old = sb.container_id
    assert _processes(old)  # its cgroup is readable here: the check after the promotion means something
    promoted = standby.promote(ck, sb.name)
    assert promoted is not None and promoted.container_id == cid and promoted.name == sb.name
    assert promoted.restored_from == ck.id and not freezer.is_frozen(cid)
    assert not _processes(old)  # the failed one is fenced: dead in the kernel's view at once
    assert {"fence_s", "thaw_s", "verify_s"} <= set(standby.last_promote)
    # Docker's names follow on a thread; a listing of the name waits for them
    assert [c["Id"] for c in sandbox_containers(docker_client, sb.name, by_name=True)
            if f"/{sb.name}" in c["Names"]] == [cid]
    wait_until(lambda: _running(docker_client, sb.name) == [cid], 30, "Docker's view of the fence")
    assert http_get(promoted) == h0 + 1  # the server's memory is the checkpoint's
    assert tree_hash(promoted, root="/w") == tree
    assert promoted.execute("ls /late")["returncode"] != 0
    n, unbroken = log_state(promoted)
    assert unbroken and n > 0
    assert standby.promote(ck, sb.name) is None  # consumed


@pytest.mark.parametrize("round_", range(3))
def test_promotion_fences_a_live_sandbox_and_its_next_command_sees_the_checkpoint(make_sandbox, ck_store,
                                                                                  docker_client, round_):
    # no sleeps: the promoted sandbox answers its next command at once, from the checkpoint's
    # state, while Docker's renames may still run; the old one never answers again
    sb = make_sandbox()
    sb.execute("echo 1 > /state; sleep 1000 &")
    ck = full_checkpoint(sb, ck_store, 1)
    standby = Standby(docker_client)
    standby.prepare(ck)
    wait_until(lambda: standby.ready() or standby.error, 120, "standby prepared")
    assert standby.error is None, standby.error
    sb.execute("echo 2 > /state")
    old = sb.container_id
    promoted = standby.promote(ck, sb.name)
    assert promoted is not None and not _processes(old)
    out = promoted.execute("cat /state; ps -o args= -C sleep")["output"]
    assert out.split("\n")[0] == "1" and "sleep 1000" in out.split("\n"), out
    assert not sb.is_alive()
    assert wait_removed(60)
    assert [c["Id"] for c in sandbox_containers(docker_client, sb.name, by_name=True)] == [promoted.container_id]


def test_standby_of_another_checkpoint_is_not_used(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    ck1 = full_checkpoint(sb, ck_store, 1)
    ck2 = full_checkpoint(sb, ck_store, 2)
    standby = Standby(docker_client)
    standby.prepare(ck1)
    wait_until(lambda: standby.ready() or standby.error, 120, "standby prepared")
    name = standby._name
    assert standby.promote(ck2, sb.name) is None
    assert sb.is_alive()  # nothing fenced
    standby.discard()
    assert not sandbox_containers(docker_client, name, by_name=True)


def test_env_rollback_onto_the_standby(make_env, docker_client):
    env = make_env(config=EnvConfig(standby=True), checkpoint_policy=AlwaysPolicy(every=2))
    env.reset(options={"task": "t"})
    env.step(COUNTER)
    env.step(BUMP.format(n=1))  # boundary 2: checkpoint, then a standby of it
    env.settle()
    standby = env.recovery.standby
    wait_until(lambda: standby is not None and (standby.ready() or standby.error), 120, "standby prepared")
    assert standby.error is None and standby.checkpoint.step == 2
    standby_id = standby._sandbox.container_id
    env.step("echo after > /after")
    kill_container(docker_client, env.sandbox.container_id)
    obs, _, _, _, info = env.step("echo lost > /lost")
    assert info["belayer"]["rollback"] == {"to_step": 2, "reason": "SandboxLost"}
    assert_no_infra_text(obs)
    assert env.sandbox.container_id == standby_id
    assert [e.kind for e in env.trajectory.events if e.kind.startswith("standby")][-1] == "standby_promoted"
    out = env.step(f"{BUMP.format(n=2)}; echo; ls /after /lost 2>&1")[0]
    assert "<output>\n2\n" in out, out  # the process's memory continued from boundary 2
    assert "'/after': No such file" in out and "'/lost': No such file" in out
    assert _running(docker_client, env.name) == [standby_id]


def test_standby_starts_when_the_checkpoint_is_published_not_at_the_next_step(make_env, docker_client):
    # a fault in the very next step is the one a standby saves most often: its restore must
    # not wait until that step starts (the env's own poll) to begin
    env = make_env(config=EnvConfig(standby=True), checkpoint_policy=AlwaysPolicy())
    env.reset(options={"task": "t"})
    env.step(COUNTER)  # boundary 1: a capture in the background
    pending = env.checkpointer._pending
    assert pending is not None
    ck = pending.wait(timeout=120)  # published; no env call since the step returned
    wait_until(lambda: env.recovery.standby is not None and env.recovery.standby.checkpoint is not None,
               30, "standby started on publication")
    standby = env.recovery.standby
    assert standby.checkpoint.id == ck.id
    wait_until(lambda: standby.ready() or standby.error, 120, "standby prepared")
    assert standby.error is None
    standby_id = standby._sandbox.container_id
    kill_container(docker_client, env.sandbox.container_id)
    _, _, _, _, info = env.step(BUMP.format(n=1))
    assert info["belayer"]["rollback"] == {"to_step": 1, "reason": "SandboxLost"}
    assert env.sandbox.container_id == standby_id  # promoted, prepared exactly once
    assert [e.kind for e in env.trajectory.events].count("standby_preparing") == 1


@pytest.mark.parametrize("phase", [Phase.STANDBY_FROZEN, Phase.STANDBY_THAWED])
def test_faults_in_standby_fall_back_to_a_consistent_restore(make_env, docker_client, phase):
    env = make_env(config=EnvConfig(standby=True), checkpoint_policy=AlwaysPolicy(every=2))
    env.reset(options={"task": "t"})
    faults = FaultInjector(env)
    try:
        faults.arm("restore", phase, "raise")
        env.step(COUNTER)
        env.step(BUMP.format(n=1))
        env.settle()
        standby = env.recovery.standby
        wait_until(lambda: standby is not None and (standby.ready() or standby.error), 120, "standby settled")
        if phase == Phase.STANDBY_FROZEN:
            assert isinstance(standby.error, InjectedFault) and not standby.ready()
        env.step("echo after > /after")
        kill_container(docker_client, env.sandbox.container_id)
        obs, _, _, _, info = env.step("echo lost > /lost")
        assert info["belayer"]["rollback"] == {"to_step": 2, "reason": "SandboxLost"}
        assert_no_infra_text(obs)
        assert any(r["kind"] == "restore_fail" and r["phase"] == phase for r in faults.injected)
        assert "standby_promoted" not in [e.kind for e in env.trajectory.events]
        out = env.step(f"{BUMP.format(n=2)}; echo; ls /after /lost 2>&1")[0]
        assert "<output>\n2\n" in out, out
        assert "'/after': No such file" in out and "'/lost': No such file" in out
        assert len(_running(docker_client, env.name)) == 1
        assert not [c for c in list_managed(docker_client) if "-standby-" in c.name and env.name in c.name
                    and c.status == "running"]
    finally:
        faults.close()


def test_policy_standby_cost_model():
    assert not NeverPolicy().wants_standby(1 << 20, 100 * GIB)
    assert AlwaysPolicy().wants_standby(1 << 20, 100 * GIB)
    assert not AlwaysPolicy().wants_standby(1 << 20, None)  # unknown memory: short
    assert not AlwaysPolicy().wants_standby(2 * GIB, 2 * GIB)  # would leave less than the reserve
    quiet = AdaptivePolicy(failure_rate=0.001)
    assert not quiet.wants_standby(1 << 20, 100 * GIB)  # failures too rare to pay its background restore
    flaky = AdaptivePolicy(failure_rate=0.2)
    assert flaky.wants_standby(1 << 20, 100 * GIB)
    assert not flaky.wants_standby(100 * GIB, 100 * GIB)  # off where memory is short
    flaky.observe_standby(0.04)  # a standby that saves nothing over its own rollback
    assert not flaky.wants_standby(1 << 20, 100 * GIB)


@pytest.mark.parametrize("round_", range(2))
def test_promotion_fences_a_container_of_the_sandbox_started_after_the_standby(make_sandbox, ck_store,
                                                                               docker_client, round_):
    # the fence's listing is taken once the standby is prepared and kept valid through the
    # kernel: a container of the sandbox started later (here a restore under its name) is
    # found from Docker's own record of it and killed before the standby thaws
    from belayer_env.restore.restore import full_restore

    sb = make_sandbox()
    sb.execute("echo 1 > /state")
    ck = full_checkpoint(sb, ck_store, 1)
    standby = Standby(docker_client)
    standby.prepare(ck)
    wait_until(lambda: standby.ready() or standby.error, 120, "standby prepared")
    assert standby.error is None, standby.error
    later = full_restore(ck, client=docker_client)  # fences sb, starts a new container of sb.name
    assert later.container_id != sb.container_id and _processes(later.container_id)
    promoted = standby.promote(ck, sb.name)
    assert promoted is not None and standby.last_promote["listed_ahead"]
    assert not _processes(later.container_id)  # dead before the standby ran
    assert promoted.execute("cat /state")["output"].strip() == "1"
    wait_until(lambda: _running(docker_client, sb.name) == [promoted.container_id], 30, "Docker's view of the fence")
