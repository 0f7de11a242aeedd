"""Replicated checkpoints (fsspec URL) and resuming an episode from them on "another node".

Another node = another local store directory and another env object; the old env is
abandoned without close() and its container killed, as a lost machine would leave them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from belayer_core.errors import CheckpointNotFound
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.env.policy import AlwaysPolicy
from belayer_env.faults.inject import kill_container
from belayer_env.restore.restore import full_restore
from belayer_env.store.replica import (
    EPISODE,
    MARKER_SUFFIX,
    ReplicaLocation,
    ReplicatedCheckpointStore,
)
from belayer_env.store.store import CheckpointStore
from tests.belayer_env.conftest_env import assert_no_infra_text
from tests.belayer_env.env.test_env_recovery import BUMP, COUNTER


@pytest.fixture
def replica_url(tmp_path):
    return (tmp_path / "shared").as_uri()


@pytest.fixture
def make_resumable(docker_client):
    """``make_resumable(**kwargs)`` -> ResumableSandboxEnv; closed newest first at teardown."""
    from belayer_env.env.resumable import ResumableSandboxEnv

    envs = []

    def make(**kwargs):
        envs.append(ResumableSandboxEnv(client=docker_client, **kwargs))
        return envs[-1]

    yield make
    for env in reversed(envs):
        env.close()


def test_replica_fetched_on_another_node_restores_files_and_processes(make_sandbox, tmp_path, replica_url):
    store_a = ReplicatedCheckpointStore(tmp_path / "node-a", replica_url, keep=None)
    sb = make_sandbox()
    sb.execute(COUNTER)
    assert sb.execute(BUMP.format(n=1))["output"].strip() == "1"
    sb.execute("echo state-1 > /tmp/state")
    ck = full_checkpoint(sb, store_a, step=1)
    root = Path(tmp_path / "shared" / sb.name)
    assert (root / f"{ck.id}{MARKER_SUFFIX}").is_file(), "no commit marker after publish"
    assert [r.id for r in store_a.replica.list()] == [ck.id]
    sb.execute("echo after > /tmp/state")
    kill_container(sb.client, sb.container_id)  # the node is gone: only the replica remains

    store_b = CheckpointStore(tmp_path / "node-b", keep=None)
    local = ReplicaLocation(replica_url).fetch(ck.id, store_b)
    assert local.path.parent.parent == store_b.path and local.step == 1
    restored = full_restore(local)
    try:
        assert restored.execute("cat /tmp/state")["output"] == "state-1\n"
        # the in-memory counter came back with its process (1), and counts on from there
        assert restored.execute(BUMP.format(n=2))["output"].strip() == "2"
    finally:
        restored.close()


def test_uncommitted_or_corrupt_replicas_are_never_used(make_sandbox, tmp_path, replica_url):
    store = ReplicatedCheckpointStore(tmp_path / "node-a", replica_url, keep=None)
    sb = make_sandbox()
    sb.execute("echo x > /tmp/x")
    ck = full_checkpoint(sb, store, step=1)
    loc = ReplicaLocation(replica_url)
    data_dir = tmp_path / "shared" / sb.name / ck.id
    # an upload cut short: data without a marker is invisible
    marker = tmp_path / "shared" / sb.name / f"{ck.id}{MARKER_SUFFIX}"
    saved = marker.read_bytes()
    marker.unlink()
    assert loc.list(sb.name) == []
    with pytest.raises(CheckpointNotFound):
        loc.fetch(ck.id, CheckpointStore(tmp_path / "node-b"))
    marker.write_bytes(saved)
    # one flipped byte in an artifact: the fetch refuses it and leaves nothing behind
    tar = data_dir / "layer.tar"
    raw = bytearray(tar.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    tar.write_bytes(bytes(raw))
    node_b = CheckpointStore(tmp_path / "node-b2")
    with pytest.raises(CheckpointNotFound, match="corrupt"):
        loc.fetch(ck.id, node_b)
    assert node_b.list() == [] and not any((node_b.path / ".staging").iterdir())
    # removing the local checkpoint uncommits its replica too
    store.remove(ck.id)
    assert loc.list(sb.name) == []


def test_cancel_landing_during_publish_leaves_nothing_published(make_sandbox, tmp_path, replica_url):
    """A capture cancelled after it was written, while it uploads and publishes: the
    published checkpoint is removed again, locally and at the URL (cancel = publish nothing)."""
    from belayer_env.capture.pending import start_checkpoint
    from belayer_env.common.phases import Phase

    store = ReplicatedCheckpointStore(tmp_path / "node-a", replica_url, keep=None)
    sb = make_sandbox()
    sb.execute("echo x > /tmp/x")
    assert full_checkpoint(sb, store, step=1).step == 1
    handle: dict = {}

    def cancel_after_write(phase):  # the cancel lands between WRITTEN and PUBLISHED
        if phase is Phase.WRITTEN:
            handle["pending"].cancel()
        handle.setdefault("phases", []).append(phase)

    handle["pending"] = pending = start_checkpoint(sb, store, 2, phase_hook=cancel_after_write, prestage=False)
    assert pending.wait(120) is None
    assert [c.step for c in store.list(sb.name)] == [1], "a cancelled capture stayed published locally"
    assert [r.step for r in ReplicaLocation(replica_url).list(sb.name)] == [1], "its replica stayed committed"
    assert Phase.PUBLISHED in handle["phases"], f"the capture did not reach publish: {handle['phases']}"
    assert sb.execute("echo running")["output"] == "running\n"
    assert full_checkpoint(sb, store, step=2).step == 2  # the step number is free again


def test_episode_resumes_on_another_env_prefix_consistent(make_resumable, docker_client, replica_url):
    env_a = make_resumable(checkpoint_policy=AlwaysPolicy(), replica_url=replica_url)
    env_a.reset(options={"task": "count", "setup": "touch /tmp/log"})
    env_a.step(COUNTER)
    for i in range(1, 4):
        env_a.settle()  # each boundary's capture done before the next step: one per boundary
        obs = env_a.step(f"echo {i} >> /tmp/log; " + BUMP.format(n=i))[0]
        assert obs.endswith(f"\n{i}</output>")
    env_a.settle()
    point = env_a.resume_point()
    assert point is not None and point["step"] == 4, point
    episode = ReplicaLocation(replica_url).episode(point["id"])
    assert [s["step"] for s in episode["steps"]] == [1, 2, 3, 4] and episode["task"] == "count"
    env_a.step("echo 4 >> /tmp/log")  # committed on node A only: lost with it
    kill_container(docker_client, env_a.sandbox.container_id)
    env_a.checkpointer.abort_inflight()  # node A's process is gone: nothing of it runs on

    env_b = make_resumable(checkpoint_policy=AlwaysPolicy(), replica_url=replica_url)
    obs, info = env_b.resume(point["id"], at_step=5, options={"task": "count", "setup": "touch /tmp/log"})
    assert info == {"belayer": {"step": 4, "rollback": {"to_step": 4, "reason": "NodeLost"}}}, env_b.trajectory.events
    assert obs == env_a.trajectory.steps[3].observation and len(env_b.trajectory.steps) == 4
    assert_no_infra_text(obs)
    rb = env_b.trajectory.events[-1]
    assert rb.kind == "rollback" and rb.at_step == 5 and rb.discarded_steps == 1 and rb.error == "NodeLost"
    # files and process memory are those of boundary 4; the agent regenerates step 5
    out = env_b.step("echo 4 >> /tmp/log; " + BUMP.format(n=4) + "; echo; cat /tmp/log")[0]
    assert out.endswith("4\n1\n2\n3\n4\n</output>"), out
    env_b.settle()
    assert env_b.resume_point()["step"] == 5
    stale = [r.id for r in ReplicaLocation(replica_url).list() if r.sandbox == env_b.name and r.step < 4]
    assert stale == [], "replicas older than the resume point were left behind"
    assert json.loads((Path(replica_url[7:]) / env_b.name / point["id"] / EPISODE).read_text())["task"] == "count"


def test_clean_incomplete_reaps_only_uploads_without_a_marker(make_sandbox, tmp_path, replica_url):
    import os
    import time

    store = ReplicatedCheckpointStore(tmp_path / "node-a", replica_url, keep=None)
    sb = make_sandbox()
    ck = full_checkpoint(sb, store, step=1)
    loc = ReplicaLocation(replica_url)
    orphan = tmp_path / "shared" / sb.name / f"{sb.name}.000002.deadbeef"  # a writer died mid-upload
    orphan.mkdir()
    (orphan / "layer.tar").write_bytes(b"partial")
    assert loc.clean_incomplete(older_than_s=3600) == [], "a fresh upload may still be running"
    old = time.time() - 7200
    os.utime(orphan, (old, old))
    assert loc.clean_incomplete(older_than_s=3600) == [str(orphan)]
    assert not orphan.exists() and [r.id for r in loc.list()] == [ck.id]
    assert loc.fetch(ck.id, CheckpointStore(tmp_path / "node-b")).step == 1


def test_local_rollback_keeps_replicas_equal_to_the_ready_branch(make_resumable, docker_client, replica_url):
    env = make_resumable(checkpoint_policy=AlwaysPolicy(), replica_url=replica_url)
    env.reset(options={"task": "t"})
    for i in range(1, 4):
        env.settle()
        env.step(f"echo {i} >> /tmp/log")
    env.settle()
    kill_container(docker_client, env.sandbox.container_id)  # a local failure, the node lives
    obs, _, _, _, info = env.step("echo 4 >> /tmp/log")
    j = info["belayer"]["rollback"]["to_step"]
    assert j == 3 and info["belayer"]["rollback"]["reason"] == "SandboxLost", info
    replicas = [r.id for r in ReplicaLocation(replica_url).list(env.name)]
    assert replicas == [c.id for c in env.checkpointer.ready] and all(
        c.step <= j for c in env.checkpointer.ready), (replicas, env.checkpointer.ready)
    assert env.step("cat /tmp/log")[0].endswith("1\n2\n3\n</output>")
