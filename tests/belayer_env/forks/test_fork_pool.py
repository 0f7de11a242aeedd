"""``ForkPool``: forks start in containers created ahead, and are the same forks.

Real containers and CRIU: pooled forks carry the checkpoint's live server and append-only
log, write independently, are labelled, fenced and reaped like any sandbox; the shared
copy they run on stays while any of them (known to it only through its alias) exists and
goes after; a checkpoint of a pooled fork restores to the fork. A pool serves only
checkpoints of containers made like its own; what it holds when its owner dies is reaped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from belayer.cli import main as cli_main
from belayer_core.errors import ConfigError, UsageError
from belayer_env import fork
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.forks.pool import ForkPool
from belayer_env.ops.gc import list_managed, sweep_shared_layers
from belayer_env.restore import prestaging
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox.fence import fence, sandbox_containers
from belayer_env.sandbox.treehash import tree_hash
from belayer_env.store import shared_layer, shared_lease
from belayer_env.store.manifest import read_manifest_digest
from tests.belayer_env.conftest_checkpoint import http_get, log_state, start_counter, start_server
from tests.conftest import wait_until


def _state(docker_client, cid: str) -> str:
    return docker_client.api.inspect_container(cid)["State"]["Status"]


@pytest.fixture
def pools():
    made: list[ForkPool] = []
    yield made
    for p in made:
        p.close()


def _source_with_a_pool(make_sandbox, pools):
    """A sandbox with a file, a counter and a server (its first count), and a pool of 2 filling."""
    src = make_sandbox()
    assert src.execute("mkdir -p /data && echo base > /data/shared")["returncode"] == 0
    start_counter(src)
    start_server(src)
    h0 = http_get(src)
    pool = ForkPool(src, 2)
    pools.append(pool)
    pool.fill()
    return src, h0, pool


def test_pooled_forks_start_in_the_pool_and_are_prefix_consistent(make_sandbox, ck_store, docker_client, pools):
    src, h0, pool = _source_with_a_pool(make_sandbox, pools)
    assert pool.wait_filled(), f"the pool did not fill: {pool.error}"
    pooled = pool.container_ids()
    managed = {c.id: c for c in list_managed(docker_client)}
    for cid in pooled:  # created, not started; a sandbox of this process's from its creation
        assert _state(docker_client, cid) == "created"
        assert cid in managed and not managed[cid].orphaned and managed[cid].sandbox
    ck = full_checkpoint(src, ck_store, 1)
    forks = fork(ck, 3, client=docker_client, pool=pool)  # two from the pool, one created now
    restored = []
    try:
        assert len(pool) == 0
        assert sorted(f.container_id for f in forks[:2]) == sorted(pooled)
        assert forks[2].container_id not in pooled
        assert {f.shared_lower for f in forks} == {forks[0].shared_lower}
        for i, f in enumerate(forks):
            assert f.is_alive() and f.restored_from == ck.id
            assert http_get(f) == h0 + 1  # the server's in-memory count continues from the checkpoint
            n, unbroken = log_state(f)
            assert unbroken
            assert f.execute(f"echo fork{i} > /data/shared && touch /data/only{i}")["returncode"] == 0
        for i, f in enumerate(forks):
            assert f.execute("cat /data/shared; ls /data")["output"] == f"fork{i}\nonly{i}\nshared\n"
            assert [c["Id"] for c in sandbox_containers(docker_client, f.name)] == [f.container_id]
        assert src.execute("cat /data/shared; ls /data")["output"] == "base\nshared\n"
        # the copy is used only through the pooled forks' aliases (and fork 2's label): sweep keeps it
        root = shared_layer.lowers_root(prestaging.docker_root(docker_client)) / forks[0].shared_lower
        fence(docker_client, forks[2].name, background=False)
        assert forks[0].shared_lower not in sweep_shared_layers(docker_client) and root.is_dir()
        assert forks[1].execute("cat /data/shared")["output"] == "fork1\n"
        # a checkpoint of a pooled fork holds its whole layer (the shared one, through the alias, and
        # its own) and restores to it
        assert forks[0].execute("mkdir -p /data/d && echo x > /data/d/f && rm /data/only0")["returncode"] == 0
        mid = tree_hash(forks[0], "/data")
        ck_f = full_checkpoint(forks[0], ck_store, 2)
        back = full_restore(ck_f, client=docker_client, name=f"{forks[0].name}-r")
        restored.append(back)
        assert back.shared_lower is None and tree_hash(back, "/data") == mid and http_get(back) == h0 + 2
        assert back.execute("cat /data/shared /data/d/f; ls /data")["output"] == "fork0\nx\nd\nshared\n"
    finally:
        for sb in [*forks, *restored]:
            fence(docker_client, sb.name, background=False)
    removed = sweep_shared_layers(docker_client)
    assert forks[0].shared_lower in removed and not root.exists()
    assert not [p for p in root.parent.iterdir() if p.name.startswith(shared_layer.ALIAS_PREFIX)
                and os.readlink(p) == root.name], "an alias outlived its forks"


def test_a_pool_serves_only_checkpoints_of_containers_made_like_its_own(make_sandbox, ck_store, docker_client,
                                                                        pools):
    a, b = make_sandbox(), make_sandbox(memory="640m")
    pool = ForkPool(a, 1)
    pools.append(pool)
    pool.fill()
    assert pool.wait_filled(), pool.error
    waiting = pool.container_ids()
    assert not pool.serves(b) and pool.serves(a)
    forks = fork(full_checkpoint(b, ck_store, 1), 1, client=docker_client, pool=pool)
    try:
        assert forks[0].container_id not in waiting and pool.container_ids() == waiting
        assert forks[0].is_alive()
    finally:
        fence(docker_client, forks[0].name, background=False)
    pool.close()
    assert len(pool) == 0
    assert not docker_client.api.containers(all=True, filters={"id": waiting[0]}), "close left a container"


def test_bad_pool_arguments_are_usage_errors(make_sandbox, ck_store, docker_client, pools):
    src = make_sandbox()
    for size in (0, -1, 65, True, 2.0):
        with pytest.raises(UsageError, match="fork pool's size"):
            ForkPool(src, size)
    pool = ForkPool(src, 1)
    pools.append(pool)
    ck = full_checkpoint(src, ck_store, 1)
    with pytest.raises(UsageError, match="fork pool"):
        fork(ck, 1, client=docker_client, pool=pool, names=["x-fork"])
    with pytest.raises(UsageError, match="fork pool"):
        fork(ck, 1, client=docker_client, pool=pool, share=False)
    with pytest.raises(UsageError, match="takes a Checkpoint"):
        pool.prepare(ck.id)  # an id, not the checkpoint
    from belayer_env.env.recoverable import EnvConfig

    with pytest.raises((ConfigError, ValueError)):
        EnvConfig(fork_pool=65)


KILLED_WITH_A_POOL = """
import os, signal, sys
from belayer_env import DockerSandbox
from belayer_env.forks.pool import ForkPool, RestoreSpare
sb = DockerSandbox(name_prefix="belayer-test-poolowner")
pool = {make}
pool.fill()
assert pool.wait_filled(), pool.error
print(sb.name, *pool.container_ids(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("make", ["ForkPool(sb, 2)", "RestoreSpare(sb)"])
def test_gc_reaps_the_pool_of_a_dead_owner(docker_client, make):
    p = subprocess.run([sys.executable, "-c", KILLED_WITH_A_POOL.replace("{make}", make)], capture_output=True,
                       text=True, timeout=180, cwd=Path(__file__).resolve().parents[3])
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    owner, *pooled = p.stdout.split()
    try:
        orphans = {c.id for c in list_managed(docker_client) if c.orphaned}
        assert pooled and set(pooled) <= orphans, "a dead owner's pooled containers are not listed as orphans"
        assert cli_main(["gc"]) == 0
        for cid in pooled:
            assert not docker_client.api.containers(all=True, filters={"id": cid}), f"gc left {cid}"
    finally:
        fence(docker_client, owner, background=False)


def test_env_forks_start_in_its_pool_and_it_refills(make_env, docker_client):
    env = make_env(checkpoint_policy="always", fork_pool=2)
    env.reset(options={"task": "t", "setup": "mkdir -p /w && echo 0 > /w/n"})
    assert env.fork_pool is not None and env.fork_pool.wait_filled(), env.fork_pool and env.fork_pool.error
    pooled = env.fork_pool.container_ids()
    env.step("echo a >> /w/log")
    # boundary 1 published: the pool verifies its layer and images ahead, before any fork
    wait_until(lambda: env.fork_pool.ahead is not None and env.fork_pool.ahead.checkpoint.step == 1, 60,
               "the pool preparing the published checkpoint")
    children = env.fork(2)
    try:
        assert env.fork_pool.ahead.checkpoint.step == 1  # kept for the next fork of boundary 1
        assert sorted(c.sandbox.container_id for c in children) == sorted(pooled)
        for i, c in enumerate(children):
            obs, *_ = c.step(f"echo fork{i} >> /w/log; cat /w/log")
            assert obs.endswith(f"a\nfork{i}\n</output>"), obs
        assert env.step("cat /w/log")[0].endswith("<output>\na\n</output>")
        assert env.fork_pool.wait_filled(), env.fork_pool.error  # refilled after the fork
        refilled = env.fork_pool.container_ids()
        assert not set(refilled) & set(pooled)
    finally:
        for c in children:
            c.close()
    env.close()
    for cid in refilled:
        assert not docker_client.api.containers(all=True, filters={"id": cid}), "close left a pooled container"


def test_a_pool_verifies_the_newest_checkpoint_ahead_and_its_forks_only_start(make_sandbox, ck_store, docker_client,
                                                                              pools, monkeypatch):
    from belayer_env.forks import fork as forking

    src, h0, pool = _source_with_a_pool(make_sandbox, pools)
    ck1 = full_checkpoint(src, ck_store, 1)
    pool.prepare(ck1)
    first = pool.ahead
    images1 = first.borrow(ck1, read_manifest_digest(Path(ck1.path))[1])  # waits for the preparation
    assert images1 is not None and any(images1.iterdir())
    first.give_back()
    assert http_get(src) == h0 + 1  # the server moves on: the two checkpoints differ in memory
    ck2 = full_checkpoint(src, ck_store, 2)
    pool.prepare(ck2)  # replaces the first: its images go, its copy is left to sweep
    assert not images1.exists()
    assert pool.wait_filled(), pool.error
    digest = read_manifest_digest(Path(ck2.path))[1]
    images2 = pool.ahead.borrow(ck2, digest)
    assert images2 is not None
    pool.ahead.give_back()
    copies = {p.name for p in shared_layer.lowers_root(prestaging.docker_root(docker_client)).iterdir()
              if shared_layer.SharedLower(p).ready()}
    assert any(digest[:12] in name for name in copies)  # unpacked and verified before any fork
    made: list[str] = []
    real_make, real_images = shared_lease.make_copy, forking.verified_images
    monkeypatch.setattr(shared_lease, "make_copy", lambda *a, **k: made.append("layer") or real_make(*a, **k))
    monkeypatch.setattr(forking, "verified_images", lambda *a, **k: made.append("images") or real_images(*a, **k))
    forks = fork(ck2, 2, client=docker_client, pool=pool)
    others = []
    try:
        assert made == []  # the fork only started containers: nothing unpacked or verified on the call
        assert images2.is_dir() and any(images2.iterdir())  # still held for the next fork of ck2
        for i, f in enumerate(forks):
            assert f.restored_from == ck2.id and http_get(f) == h0 + 2
            n, unbroken = log_state(f)
            assert unbroken and n > 0
            assert f.execute(f"echo fork{i} > /data/shared")["returncode"] == 0
        assert [f.execute("cat /data/shared")["output"] for f in forks] == ["fork0\n", "fork1\n"]
        assert src.execute("cat /data/shared")["output"] == "base\n"
        others = fork(ck1, 1, client=docker_client, pool=pool)  # another checkpoint: verified on the call
        assert others[0].restored_from == ck1.id and http_get(others[0]) == h0 + 1
        assert made.count("images") == 1
    finally:
        for f in [*forks, *others]:
            fence(docker_client, f.name, background=False)
    pool.close()
    assert not images2.exists()  # closing the pool lets the images go, and the copies no fork uses
    lowers = shared_layer.lowers_root(prestaging.docker_root(docker_client))
    assert not [n for n in copies if (lowers / n).exists()]
