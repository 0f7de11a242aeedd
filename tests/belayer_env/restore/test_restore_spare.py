"""``RestoreSpare``: a restore starts in a container created ahead, and is the same restore.

Real containers and CRIU: the sandbox restored into its spare carries the checkpoint's
live server, append-only log and file tree (pre-staged or not), under the sandbox's name,
with the disk cap; the spare is not fenced with the sandbox it waits for, serves only
checkpoints of containers made like it; the env uses and refills it on a rollback. (Reaped
with a dead owner: ``test_fork_pool.test_gc_reaps_the_pool_of_a_dead_owner``.)
"""

from __future__ import annotations

import os

import pytest

from belayer_core.errors import UsageError
from belayer_env import fork
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.faults.inject import kill_container
from belayer_env.ops.gc import list_managed
from belayer_env.restore.prestaging import prestage
from belayer_env.restore.restore import full_restore
from belayer_env.restore.spare import RestoreSpare
from belayer_env.sandbox.fence import fence, sandbox_containers
from belayer_env.sandbox.treehash import tree_hash
from tests.belayer_env.conftest_checkpoint import http_get, log_state, start_counter, start_server


def _status(docker_client, cid: str) -> str:
    return docker_client.api.inspect_container(cid)["State"]["Status"]


def _capped(docker_client, cid: str, cap: int) -> bool:
    """The container's writable layer is a file system of its own, no bigger than ``cap``."""
    layer = os.path.dirname(docker_client.api.inspect_container(cid)["GraphDriver"]["Data"]["UpperDir"])
    with open("/proc/self/mountinfo") as f:
        mounted = any(line.split()[4] == layer for line in f)
    st = os.statvfs(layer)
    return mounted and st.f_blocks * st.f_frsize <= cap


@pytest.fixture
def spares():
    made: list[RestoreSpare] = []
    yield made
    for s in made:
        s.close()


@pytest.mark.parametrize("prestaged", [False, True], ids=["unpacked", "prestaged"])
def test_a_restore_starts_in_the_spare_and_is_the_checkpoint(make_sandbox, ck_store, docker_client, spares,
                                                              prestaged):
    src = make_sandbox(disk="512m")
    assert src.execute("mkdir -p /data && echo kept > /data/f && seq 1000 > /data/g")["returncode"] == 0
    start_counter(src)
    start_server(src)
    h0 = http_get(src)
    spare = RestoreSpare(src)
    spares.append(spare)
    spare.fill()
    assert spare.wait_filled(), f"the spare was not created: {spare.error}"
    (waiting,) = spare.container_ids()
    managed = {c.id: c for c in list_managed(docker_client)}
    assert _status(docker_client, waiting) == "created" and not managed[waiting].orphaned
    ck = full_checkpoint(src, ck_store, 1)
    data_hash = tree_hash(src, "/data")
    phases: list[str] = []
    if prestaged:
        assert prestage(ck, docker_client) is not None
    fence(docker_client, src.name, background=False)  # not the spare: it is a sandbox of its own name
    assert _status(docker_client, waiting) == "created"
    back = full_restore(ck, client=docker_client, spare=spare, phase_hook=phases.append)
    try:
        assert ("staged" in phases) == prestaged, phases
        assert back.container_id == waiting and back.name == src.name and len(spare) == 0
        assert [c["Id"] for c in sandbox_containers(docker_client, src.name, by_name=True)] == [waiting]
        assert http_get(back) == h0 + 1  # the server's in-memory count continues from the checkpoint
        assert log_state(back)[1]
        assert tree_hash(back, "/data") == data_hash
        assert _capped(docker_client, waiting, 512 * 2**20), "the spare's layer lacks the sandbox's disk cap"
        assert back.execute("echo more >> /data/f && cat /data/f")["output"] == "kept\nmore\n"
    finally:
        fence(docker_client, back.name, background=False)


def test_a_spare_serves_only_checkpoints_of_containers_made_like_it(make_sandbox, ck_store, docker_client,
                                                                      spares):
    a, b = make_sandbox(), make_sandbox(memory="640m")
    spare = RestoreSpare(a)
    spares.append(spare)
    spare.fill()
    assert spare.wait_filled(), spare.error
    waiting = spare.container_ids()
    assert spare.serves(a) and not spare.serves(b)
    ck = full_checkpoint(b, ck_store, 1)
    back = full_restore(ck, client=docker_client, spare=spare)
    try:
        assert back.container_id not in waiting and spare.container_ids() == waiting
        assert _status(docker_client, waiting[0]) == "created" and back.is_alive()
    finally:
        fence(docker_client, back.name, background=False)
    with pytest.raises(UsageError, match="restore spare"):
        fork(full_checkpoint(a, ck_store, 2), 1, client=docker_client, pool=spare)
    spare.close()
    assert not docker_client.api.containers(all=True, filters={"id": waiting[0]}), "close left the spare"


def test_env_rolls_back_into_its_spare_and_refills_it(make_env, docker_client):
    env = make_env(checkpoint_policy="always", restore_spare=True)
    env.reset(options={"task": "t", "setup": "mkdir -p /w && echo 0 > /w/n"})
    assert env.restore_spare is not None and env.restore_spare.wait_filled(), env.restore_spare.error
    (waiting,) = env.restore_spare.container_ids()
    env.step("echo a >> /w/log")
    env.settle()
    kill_container(docker_client, env.sandbox.container_id)
    obs, _r, _te, _tr, info = env.step("echo lost >> /w/log")
    assert info["belayer"]["rollback"] == {"to_step": 1, "reason": "SandboxLost"}
    assert env.sandbox.container_id == waiting and env.sandbox.name == env.name
    assert env.step("cat /w/log")[0].endswith("<output>\na\n</output>")
    assert env.restore_spare.wait_filled(), env.restore_spare.error  # refilled after the rollback
    (refilled,) = env.restore_spare.container_ids()
    assert refilled != waiting
    env.reset(options={"task": "t2", "setup": "mkdir -p /w"})  # a new episode, made alike: the spare stays
    assert env.restore_spare.container_ids() == [refilled]
    env.step("echo b >> /w/log")
    env.settle()
    kill_container(docker_client, env.sandbox.container_id)
    assert env.step("echo lost >> /w/log")[4]["belayer"]["rollback"]["to_step"] == 1
    assert env.sandbox.container_id == refilled and env.step("cat /w/log")[0].endswith("<output>\nb\n</output>")
    assert env.restore_spare.wait_filled(), env.restore_spare.error
    (refilled,) = env.restore_spare.container_ids()
    env.close()
    assert not docker_client.api.containers(all=True, filters={"id": refilled}), "close left the spare"
