"""The SGLang servers' KV pool, context and batch (``sizing.py``) and the arena-KV mode's
flags: what users run by default on a GPU, small on CPU, every bad value a clear error."""

from __future__ import annotations

import json

import pytest

from belayer_core.errors import ConfigError
from belayer_engine.backends.base import SlotSpec, WorkerSpec
from belayer_engine.backends.sglang import sizing
from belayer_engine.backends.sglang.backend import SGLangBackend
from belayer_engine.backends.sglang.sizing import flag_value, kv_plan, kv_tokens_for_fraction

QWEN3_4B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_size": 2560, "torch_dtype": "bfloat16", "max_position_embeddings": 40960}


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
    with open(tmp_path / "model.safetensors", "wb") as fh:
        fh.truncate(8 << 30)  # 8 GiB of weights (sparse)
    return str(tmp_path)


def test_a_gpu_pool_is_most_of_the_device_after_the_weights(model, monkeypatch):
    monkeypatch.setattr(sizing, "device_total_mib", lambda device: 80 * 1024)  # an H100's 80 GiB
    per_token = 36 * 2 * 8 * 128 * 2
    assert sizing.kv_bytes_per_token(model) == per_token == 147456
    tokens = kv_tokens_for_fraction(model, "cuda:0", 0.8)
    assert tokens == int((0.8 * 80 * 2**30 - 8 * 2**30) // per_token)  # 56 GiB of KV: ~407K tokens
    assert kv_plan(None, None, [], model, "cuda:0") == (tokens, 4096)  # the reserve: 1/64, at most 4,096
    assert kv_plan(None, None, ["--max-total-tokens", "9000"], model, "cuda:0") == (9000, 512)
    assert kv_plan(None, None, [], model, "cpu") == (4096, 512)
    assert sizing.context_default(model, "cuda:0") == 40960 and sizing.context_default(model, "cpu") == 2048


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"tokens": 10}, "at least 64"), ({"reserve": 0}, "at least 1"), ({"fraction": 1.5}, "between 0 and 1"),
    ({"fraction": 0.05}, "leaves no room"),
])
def test_bad_sizes_are_errors_naming_the_option(model, monkeypatch, kwargs, words):
    monkeypatch.setattr(sizing, "device_total_mib", lambda device: 80 * 1024)
    args = {"tokens": None, "reserve": None, "fraction": None, **kwargs}
    with pytest.raises(ConfigError, match=words):
        kv_plan(args["tokens"], args["reserve"], [], model, "cuda:0", args["fraction"])


def test_an_unreadable_device_or_model_asks_for_the_token_count(tmp_path, monkeypatch):
    monkeypatch.setattr(sizing, "device_total_mib", lambda device: None)
    with pytest.raises(ConfigError, match="give sglang_kv_tokens"):
        kv_plan(None, None, [], str(tmp_path), "cuda:0")


def _venv(tmp_path) -> str:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    return str(tmp_path / "venv")


def test_arena_kv_servers_map_the_arenas_pool_and_take_its_size(model, tmp_path, monkeypatch):
    monkeypatch.setattr(sizing, "device_total_mib", lambda device: 80 * 1024)
    backend = SGLangBackend(model, venv=_venv(tmp_path), device="cuda:0", kv_fraction=0.5)
    slot = SlotSpec(name="w0", device="cuda:0", arena_socket=tmp_path / "a.sock", run_dir=tmp_path)
    argv = backend.worker_argv(slot, WorkerSpec(worker_id="w0-shadow-2", host="127.0.0.1", port=1234, shadow=True))
    assert argv[argv.index("--kv-arena") + 1] == str(slot.arena_socket) and "shadow" in argv
    assert flag_value(argv, ("--max-total-tokens",)) == str(backend.kv_tokens)
    assert flag_value(argv, ("--context-length",)) == "40960" and flag_value(argv, ("--max-running-requests",)) == "64"
    assert "--kv-pool" in backend.arena_argv(slot) and not backend.shadow_memory_saver
    own = SGLangBackend(model, ["--context-length", "8192"], venv=_venv(tmp_path / "b"), device="cuda:0",
                        kv_tokens=100000)
    argv = own.worker_argv(slot, WorkerSpec(worker_id="w0-worker-1", host="127.0.0.1", port=1234, shadow=False))
    assert flag_value(argv, ("--context-length",)) == "8192" and flag_value(argv, ("--max-total-tokens",)) == "100000"


def test_the_memory_saver_belongs_to_servers_that_own_their_kv(model, tmp_path):
    with pytest.raises(ConfigError, match="no KV pool of its own"):
        SGLangBackend(model, venv=_venv(tmp_path), device="cuda:0", kv_tokens=4096, shadow_memory_saver=True)
    with pytest.raises(ConfigError, match="sglang_kv must be"):
        SGLangBackend(model, venv=_venv(tmp_path / "b"), kv="both")
    with pytest.raises(ConfigError, match="sizes the arena's pool"):
        SGLangBackend(model, venv=_venv(tmp_path / "c"), kv="server", kv_fraction=0.5)
