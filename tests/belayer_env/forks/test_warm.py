"""Warm forks: a checkpoint's forks restored ahead and frozen; ``fork(..., warm=)`` thaws them.

Real containers and CRIU. The properties: prepared forks are frozen (they cannot diverge)
and Docker's view of them is running; a fork taken from them is at the checkpoint's boundary
(a live server's memory, the same file tree) and independent of its siblings; a warm set of
another checkpoint is never used; closing fences the ones not taken.
"""

from __future__ import annotations

import pytest

from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.forks.fork import fork, warm_forks
from belayer_env.sandbox import freezer
from belayer_env.sandbox.fence import sandbox_containers
from belayer_env.sandbox.treehash import tree_hash
from tests.belayer_env.conftest_checkpoint import http_get, start_server


@pytest.mark.parametrize("round_", range(2))
def test_warm_forks_thaw_at_the_checkpoint(make_sandbox, ck_store, docker_client, round_):
    sb = make_sandbox()
    start_server(sb)
    sb.execute("mkdir -p /w && echo base > /w/state")
    h0 = http_get(sb)
    tree = tree_hash(sb, root="/w")
    ck = full_checkpoint(sb, ck_store, 1)
    sb.execute("echo later > /w/state")  # the source moves on: never seen by a fork
    warm = warm_forks(ck, 3, client=docker_client)
    try:
        assert warm.done.wait(300) and warm.ready(), warm.error
        ids = [f.container_id for f, _ in warm._forks]
        assert all(freezer.is_frozen(c) for c in ids)
        assert not any(docker_client.api.inspect_container(c)["State"]["Paused"] for c in ids)
        forks = fork(ck, 2, client=docker_client, warm=warm)
        assert [f.container_id for f in forks] == ids[:2] and set(warm.last_take) == {"thaw_s", "verify_s"}
        assert freezer.is_frozen(ids[2])  # the one not taken stays frozen
        for i, f in enumerate(forks):
            assert tree_hash(f, root="/w") == tree
            assert http_get(f) == h0 + 1  # the server's memory is the checkpoint's
            f.execute(f"echo {i} > /w/state")
        assert [f.execute("cat /w/state")["output"].strip() for f in forks] == ["0", "1"]  # independent
        assert sb.execute("cat /w/state")["output"].strip() == "later"
        left = warm._forks[0][0].name
    finally:
        warm.close()
    assert not sandbox_containers(docker_client, left, by_name=True)
    for f in forks:
        f.close()


def test_warm_forks_of_another_checkpoint_are_not_used(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    ck1 = full_checkpoint(sb, ck_store, 1)
    sb.execute("echo two > /two")
    ck2 = full_checkpoint(sb, ck_store, 2)
    warm = warm_forks(ck1, 1, client=docker_client)
    try:
        assert warm.done.wait(300) and warm.ready(), warm.error
        forks = fork(ck2, 1, client=docker_client, warm=warm)
        assert not warm.last_take and warm.ready()  # restored the usual way, the warm one kept
        assert forks[0].execute("cat /two")["returncode"] == 0
        forks += fork(ck1, 2, client=docker_client, warm=warm)  # more than it holds: restored too
        assert not warm.last_take and len(forks) == 3
    finally:
        warm.close()
    for f in forks:
        f.close()
