"""Arena server as a real process: describe, health, updates, socket mode, cleanup."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from belayer.errors import ArenaLost, UsageError
from belayer_engine.arena_client import ArenaClient
from belayer_engine.model_config import ModelConfig
from belayer_engine.weights import init_weights

from .conftest import Arena, poll


def test_describe_health_and_permissions(tmp_path, procs):
    arena = Arena(tmp_path, "--num-blocks", "32")
    procs.append(arena)
    d = arena.client.describe()
    assert d["version"] == 0 and d["kv"]["num_blocks"] == 32
    assert ModelConfig(**d["model"]) == ModelConfig()
    assert stat.S_IMODE(os.stat(arena.socket).st_mode) == 0o600
    for h in d["regions"].values():
        assert h["kind"] == "shm" and stat.S_IMODE(os.stat(h["path"]).st_mode) == 0o600
    h = arena.client.health()
    assert h["status"] == "ok" and h["device_ok"] and h["owner_pid"] == arena.pid


def test_update_weights_versions_and_errors(tmp_path, procs):
    arena = Arena(tmp_path)
    procs.append(arena)
    c = arena.client
    before = c.checksums()
    w = init_weights(ModelConfig(), 5)
    assert c.update_weights(w) == 1
    after = c.checksums()
    assert after["w1"] != before["w1"] and after["w0"] == before["w0"]  # written into the free slot
    assert c.update_weights({"model.norm.weight": w["model.norm.weight"] * 2}) == 2
    assert c.checksums()["w1"] == after["w1"]  # slot of version 1 untouched by version 2
    with pytest.raises(UsageError, match="unknown weight"):
        c.update_weights({"nope": torch.zeros(2)})
    with pytest.raises(UsageError, match="shape"):
        c.update_weights({"model.norm.weight": torch.zeros(3)})
    assert c.describe()["version"] == 2


def test_shutdown_removes_shared_memory(tmp_path, procs):
    arena = Arena(tmp_path)
    procs.append(arena)
    paths = [h["path"] for h in arena.client.describe()["regions"].values()]
    arena.client.shutdown()
    poll(lambda: not arena.alive(), 20, "arena to exit after shutdown")
    assert not any(Path(p).exists() for p in paths)
    assert not Path(arena.socket).exists()
    with pytest.raises(ArenaLost):
        ArenaClient(arena.socket, timeout=2).health()
