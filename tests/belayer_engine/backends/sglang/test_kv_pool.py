"""The arena's KV pool for SGLang servers (``kv_pool.py``), against a real arena process: one
pool mapped by every server, a table and a journal per server that outlive it, the reserve
handed from worker to shadow only once the dead worker is reaped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from belayer_core.errors import UsageError
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import init_weights
from tests.belayer_engine.conftest import Arena

HOOKS = Path(__file__).resolve().parents[4] / "belayer_engine" / "backends" / "sglang" / "kv_hooks"
sys.path.insert(0, str(HOOKS))
import belayer_kv_arena  # noqa: E402
import belayer_kv_journal as jr  # noqa: E402

RESERVE = 16
MODEL = ModelConfig()  # the arena's embedded small model
POOL = {"layers": MODEL.num_hidden_layers, "heads": MODEL.num_key_value_heads, "head_dim": MODEL.head_dim,
        "dtype": "float32", "tokens": 64}


@pytest.fixture
def arena(tmp_path, procs, monkeypatch):
    monkeypatch.setenv("BELAYER_SHM_DIR", str(tmp_path))
    a = Arena(tmp_path, "--weight-cache-socket", str(tmp_path / "w.sock"), "--no-reference-slots", "--kv-pool",
              "--kv-reserve-tokens", str(RESERVE), module="belayer_engine.backends.sglang.arena")
    procs.append(a)
    monkeypatch.setenv("BELAYER_KV_ARENA", a.socket)  # what the servers' hook reads
    return a


def _attach(arena, sid: str, role: str, **pool) -> dict:
    return arena.client.op("kv_attach", sid=sid, role=role, table=[5, 32], pool={**POOL, **pool})


def test_servers_map_one_pool_and_the_reserve_passes_to_the_shadow_only_after_the_reap(arena):
    with pytest.raises(belayer_kv_arena.NoWorkerYet):  # the hook's client: a shadow waits for its worker
        belayer_kv_arena.call("kv_attach", sid="s", role="shadow", table=[5, 32], pool=POOL)
    worker = _attach(arena, "http://w", "worker")
    rows = 1 + POOL["tokens"] + RESERVE
    assert worker["pool"]["rows"] == rows and worker["predecessor"] is None
    pool_w = belayer_kv_arena.tensor(worker["pool_handle"])
    assert pool_w.shape == (POOL["layers"], 2, rows, POOL["heads"], POOL["head_dim"])
    jw = jr.open_journal(worker["journal"])
    assert jw.header[jr.H_RESERVE_READY] == 1 and jw.reserve.tolist() == list(range(rows - RESERVE, rows))

    shadow = _attach(arena, "http://s", "shadow")
    assert shadow["predecessor"]["sid"] == "http://w" and shadow["predecessor"]["journal"] == worker["journal"]
    pool_s = belayer_kv_arena.tensor(shadow["pool_handle"])
    pool_w[1, 0, 7] = 3.5  # written by the worker: read by the shadow, no copy
    assert float(pool_s[1, 0, 7, 0, 0]) == 3.5
    table_w = belayer_kv_arena.tensor(worker["table_handle"])
    table_w[2, :3] = torch.tensor([9, 10, 11], dtype=torch.int32)
    seen = belayer_kv_arena.tensor(shadow["predecessor"]["table_handle"])
    assert seen[2, :3].tolist() == [9, 10, 11]  # the worker's table, as its successor maps it

    js = jr.open_journal(shadow["journal"])
    arena.client.op("kv_promoted", sid="http://s", predecessor="http://w")
    assert js.header[jr.H_RESERVE_READY] == 0  # the dead worker may still have kernels in flight
    assert arena.client.describe()["kv_pool"]["worker"] == "http://s"
    arena.client.op("kv_reaped", sid="http://w")
    assert jw.header[jr.H_REAPED] == 1 and js.header[jr.H_RESERVE_READY] == 1
    assert not Path(worker["journal"]).exists()  # adopted from and reaped: gone from the arena
    assert set(arena.client.describe()["kv_pool"]["servers"]) == {"http://s"}
    jw.close()
    js.close()


def test_a_weight_update_reaches_every_journal(arena):
    worker = _attach(arena, "http://w", "worker")
    j = jr.open_journal(worker["journal"])
    assert j.header[jr.H_VERSION] == 0
    w = init_weights(MODEL, 3)
    assert arena.client.update_weights({"model.norm.weight": w["model.norm.weight"]}) == 1
    assert j.header[jr.H_VERSION] == 1  # KV journaled from now on carries it; older rows are never adopted
    j.close()


@pytest.mark.parametrize(("change", "words"), [
    ({"dtype": "float8_e4m3fn"}, "FP8 KV is refused"),
    ({"layers": 3}, "does not fit the model"),
])
def test_a_pool_the_arena_cannot_serve_is_refused(arena, change, words):
    with pytest.raises(UsageError, match=words):
        _attach(arena, "http://w", "worker", **change)


def test_a_second_server_must_ask_for_the_same_pool_and_a_sane_table(arena):
    _attach(arena, "http://w", "worker")
    with pytest.raises(UsageError, match="differs from the arena's"):
        _attach(arena, "http://s", "shadow", tokens=65)
    with pytest.raises(UsageError, match="table"):
        arena.client.op("kv_attach", sid="http://t", role="shadow", table=[1 << 20, 1 << 20], pool=POOL)
    with pytest.raises(UsageError, match="attached already"):
        _attach(arena, "http://w", "worker")
    with pytest.raises(UsageError, match="role"):
        arena.client.op("kv_attach", sid="http://x", role="boss", table=[5, 32], pool=POOL)
