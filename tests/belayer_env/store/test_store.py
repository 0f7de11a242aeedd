"""CheckpointStore bookkeeping (no containers: checkpoints are written through the store API)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from belayer_core.errors import CheckpointFailed, CheckpointNotFound
from belayer_env.capture.checkpoint import new_id
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.store.manifest import write_manifest
from belayer_env.store.store import CheckpointStore


def publish(store: CheckpointStore, sandbox: str, step: int, payload: bytes = b"x" * 100):
    ck_id = new_id(sandbox, step)
    d = store.new_staging(ck_id)
    (d / "layer.tar").write_bytes(payload)
    import hashlib

    write_manifest(d, {
        "id": ck_id, "sandbox": sandbox, "step": step, "created": float(step), "frozen_s": 0.01,
        "total_s": 0.1, "size_bytes": len(payload), "has_runtime": False,
        "config": SandboxConfig().model_dump(mode="json"),
        "files": {"layer.tar": {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}},
    })
    return store.publish(d, sandbox, ck_id)


def test_listing_latest_get_and_sizes(tmp_path):
    store = CheckpointStore(tmp_path / "s", keep=None)
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700
    a1, a2, b1 = publish(store, "sb-a", 1), publish(store, "sb-a", 2, b"y" * 50), publish(store, "sb.b", 1)
    assert [c.id for c in store.list()] == [a1.id, a2.id, b1.id]
    assert store.latest("sb-a") == a2 and store.latest("nothing") is None
    assert store.get(b1.id) == b1 and b1.sandbox == "sb.b"
    assert store.total_bytes() == 250 and store.total_bytes("sb-a") == 150
    assert store.next_step("sb-a") == 3 and store.next_step("sb.b") == 2 and store.next_step("new") == 1
    with pytest.raises(CheckpointNotFound):
        store.get("sb-a.000009.deadbeef")
    with pytest.raises(CheckpointNotFound):
        store.get("../etc")


def test_dir_without_manifest_is_not_a_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "s")
    (store.path / "sb" / "sb.000001.aaaaaaaa").mkdir(parents=True)
    assert store.list() == []


def test_prune_keeps_newest_and_remove(tmp_path):
    store = CheckpointStore(tmp_path / "s", keep=2)
    cks = [publish(store, "sb", i) for i in range(1, 5)]
    assert store.prune("sb") == [cks[0].id, cks[1].id]
    assert [c.step for c in store.list("sb")] == [3, 4]
    store.remove(cks[3].id)
    assert [c.step for c in store.list("sb")] == [3]
    assert not list((store.path / ".trash").iterdir())


def test_clean_incomplete_removes_only_dead_writers(tmp_path):
    store = CheckpointStore(tmp_path / "s", scratch=tmp_path)
    mine = store.new_staging("sb.000001.00000000")
    dead = subprocess.run([sys.executable, "-c", "from belayer_env.store.store import CheckpointStore as S; "
                           f"S({str(store.path)!r}, scratch={str(tmp_path)!r}).new_staging('sb.000002.11111111'); "
                           f"S({str(store.path)!r}, scratch={str(tmp_path)!r}).new_scratch('sb.000002.11111111')"],
                          check=True)
    assert dead.returncode == 0
    removed = store.clean_incomplete()
    assert len(removed) == 2 and all("000002" in r for r in removed)
    assert mine.exists()


def test_one_checkpoint_per_sandbox_at_a_time(tmp_path):
    store = CheckpointStore(tmp_path / "s")
    with store.lock("sb"), pytest.raises(CheckpointFailed, match="in progress"), store.lock("sb"):
        pass
    with store.lock("other"):
        pass


def test_cli_ls_and_rm(tmp_path, capsys):
    from belayer.cli import main

    store = CheckpointStore(tmp_path / "s", keep=None)
    a, b = publish(store, "sb", 1), publish(store, "sb", 2)
    assert main(["checkpoints", "ls", "--store", str(store.path), "--json"]) == 0
    listed = __import__("json").loads(capsys.readouterr().out)
    assert [c["id"] for c in listed["checkpoints"]] == [a.id, b.id] and listed["total_bytes"] == 200
    assert main(["checkpoints", "rm", "--store", str(store.path), a.id]) == 0
    assert [c.id for c in store.list()] == [b.id]
    assert main(["checkpoints", "rm", "--store", str(store.path), "sb.000009.00000000"]) == 2  # usage error
    assert main(["checkpoints", "rm", "--store", str(store.path), "--sandbox", "sb"]) == 0
    assert store.list() == []
