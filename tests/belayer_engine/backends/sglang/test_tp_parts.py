"""Tensor parallel without a server: the arena's weight cache hands each rank exactly its
shard over SGLang's own socket protocol and an update lands in every rank's shard; the
engine picks each rank's cores, refuses what it cannot honour, and takes a tp > 1 update
payload (one entry per rank, all equal). (Servers: ``test_tensor_parallel.py``.)"""

from __future__ import annotations

import base64
import pickle
import socket
import struct
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from belayer_core.errors import ConfigError, UsageError, WorkerLost
from belayer_engine.backends.sglang.launcher import (
    BIND_VAR,
    SGLangServerConfig,
    cpu_binding,
    server_env,
)
from belayer_engine.backends.sglang.model_dir import embedded_config, ensure_embedded_model
from belayer_engine.backends.sglang.tp_layout import shard
from belayer_engine.backends.sglang.weight_cache import WeightCacheExport
from belayer_engine.model.weights import init_weights


def _fetch(path: str, config: dict) -> dict:
    """SGLang's IpcModelLoader's request (4-byte length + pickle), as a client sends it."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        data = pickle.dumps({"type": "fetch_state", "config": config})
        sock.sendall(struct.pack("!I", len(data)) + data)
        (n,) = struct.unpack("!I", sock.recv(4, socket.MSG_WAITALL))
        return pickle.loads(sock.recv(n, socket.MSG_WAITALL))


def _tensor(entry: dict) -> torch.Tensor:
    return ForkingPickler.loads(base64.b64decode(entry["handle"]))


def test_each_rank_fetches_its_own_shard_and_an_update_reaches_every_rank(tmp_path):
    cfg = embedded_config(vocab_size=500)
    hf = init_weights(cfg, seed=3)
    path = str(tmp_path / "wc.sock")
    export = WeightCacheExport(cfg, hf, path, torch.device("cpu"), tp_size=2)
    export.start()
    try:
        for rank in (0, 1):
            reply = _fetch(path, {"tp_size": 2, "tp_rank": rank, "pp_size": 1})
            assert reply["status"] == "ok"
            want = shard(cfg, hf, rank, 2)
            assert set(reply["entries"]) == set(want)
            for name, t in want.items():  # the mapped tensor is the rank's bytes, shared
                assert torch.equal(_tensor(reply["entries"][name]), t), (rank, name)
        for bad in ({"tp_size": 1, "tp_rank": 0}, {"tp_size": 2, "tp_rank": 2}, {"tp_size": 2, "tp_rank": "0"},
                    {"tp_size": 4, "tp_rank": 1}, {"tp_size": 2, "tp_rank": 0, "pp_size": 2}):
            reply = _fetch(path, bad)
            assert reply == {"status": "mismatch", "daemon_config": {"tp_size": 2, "pp_size": 1}}, bad
        mapped = [{n: _tensor(e) for n, e in _fetch(path, {"tp_size": 2, "tp_rank": r})["entries"].items()}
                  for r in (0, 1)]
        new = init_weights(cfg, seed=4)
        name = "model.layers.1.self_attn.o_proj.weight"  # split by input columns
        export.update_weights({name: new[name], "model.embed_tokens.weight": new["model.embed_tokens.weight"]}, 1)
        for rank in (0, 1):
            want = shard(cfg, {**hf, name: new[name], "model.embed_tokens.weight": new["model.embed_tokens.weight"]},
                         rank, 2)
            for n, t in want.items():  # what every mapper of the rank sees, in place
                assert torch.equal(mapped[rank][n], t), (rank, n)
        assert export.describe()["tp_size"] == 2 and export.version == 1
    finally:
        export.close()


def test_a_server_that_does_not_pause_fails_the_update_and_a_gone_one_is_dropped(tmp_path):
    """A silent server (a stopped rank holds its group) may serve again: the update raises so
    its slot is restarted, never leaving it on the new tensors with its old cache; a server
    whose port is closed is gone, and simply dropped."""
    cfg = embedded_config(vocab_size=500)
    hf = init_weights(cfg, seed=5)
    export = WeightCacheExport(cfg, hf, str(tmp_path / "wc.sock"), torch.device("cpu"), http_timeout_s=1.0, tp_size=2)
    silent = socket.socket()  # accepts (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    silent_url, gone_url = (f"http://127.0.0.1:{s.getsockname()[1]}" for s in (silent, gone))
    export.servers = {silent_url: {"role": "worker", "pid": 0}, gone_url: {"role": "shadow", "pid": 0}}
    try:
        new = init_weights(cfg, seed=6)
        with pytest.raises(WorkerLost, match="not paused: must be fenced") as failed:
            export.update_weights({"model.norm.weight": new["model.norm.weight"]}, 1)
        assert silent_url in str(failed.value) and gone_url not in str(failed.value)
        assert export.servers == {}, "neither is synced again"
    finally:
        silent.close()
        gone.close()


def test_a_shard_layout_the_model_cannot_split_is_refused(tmp_path):
    cfg = embedded_config(vocab_size=500)
    with pytest.raises(UsageError, match="do not split"):
        WeightCacheExport(cfg, init_weights(cfg, seed=1), str(tmp_path / "s"), torch.device("cpu"), tp_size=3)


@pytest.mark.parametrize("cores, tp, threads, worker, shadow", [
    ([0, 1], 2, 1, "0|1", "0|1"),  # CI: no room for a second group, the idle shadow shares
    (list(range(16)), 2, 1, "0|1", "2|3"),
    (list(range(16)), 2, 4, "0-3|4-7", "8-11|12-15"),
    (list(range(16)), 4, 4, "0-3|4-7|8-11|12-15", "0-3|4-7|8-11|12-15"),
    ([0, 1], 4, 1, "0|1|0|1", "0|1|0|1"),  # more ranks than cores: they share, none is left out
    ([2, 3, 6, 7], 2, 2, "2-3|6-7", "2-3|6-7"),  # only the cores this process may run on
])
def test_each_rank_gets_its_cores(cores, tp, threads, worker, shadow):
    assert cpu_binding(tp, threads, False, cores) == worker
    assert cpu_binding(tp, threads, True, cores) == shadow


def test_cpu_ranks_are_bound_unless_the_user_bound_them(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    cfg = SGLangServerConfig(model_path="/m", port=30123, venv=str(venv), extra_args=["--tp-size", "2"])
    assert BIND_VAR in server_env(cfg, base={"PATH": "/bin"})
    assert server_env(cfg, base={"PATH": "/bin", BIND_VAR: "0|1"})[BIND_VAR] == "0|1"
    assert BIND_VAR not in server_env(cfg.model_copy(update={"extra_args": []}), base={"PATH": "/bin"})
    monkeypatch.setenv("BELAYER_SGLANG_CPU_THREADS", "two")
    with pytest.raises(ConfigError, match="BELAYER_SGLANG_CPU_THREADS='two'"):
        SGLangServerConfig(model_path="/m", port=30123, venv=str(venv))
    monkeypatch.setenv("BELAYER_SGLANG_CPU_THREADS", "2")
    assert server_env(SGLangServerConfig(model_path="/m", port=30123, venv=str(venv), extra_args=["--tp-size", "2"]),
                      base={"PATH": "/bin"})["OMP_NUM_THREADS"] == "2"


def _backend(tmp_path, **kw):
    from belayer_engine.backends.sglang.backend import SGLangBackend

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").write_text("")
    return SGLangBackend(str(ensure_embedded_model()), venv=str(venv), **kw)


def test_the_backend_serves_tp_with_server_kv_and_refuses_what_it_cannot_honour(tmp_path):
    from belayer_engine.backends.base import SlotSpec

    backend = _backend(tmp_path, extra_args=["--tp-size", "2"])
    assert backend.tp == 2 and backend.kv == "server"  # the arena's pool is one rank's
    slot = SlotSpec(name="w0", device="cpu", arena_socket=tmp_path / "a.sock", run_dir=tmp_path)
    argv = backend.arena_argv(slot)
    assert argv[argv.index("--tp-size") + 1] == "2" and "--kv-pool" not in argv
    with pytest.raises(ConfigError, match="sglang_kv='arena' holds one server's KV pool"):
        _backend(tmp_path, extra_args=["--tp-size", "2"], kv="arena")
    with pytest.raises(ConfigError, match="do not split"):
        _backend(tmp_path, extra_args=["--tp-size", "3"])
    with pytest.raises(ConfigError, match=r"pads 8 attention / 2 kv heads .* \(1, 2\)"):
        _backend(tmp_path, extra_args=["--tp-size", "4"])  # SGLang's CPU layout; found by a tp 4 run
    with pytest.raises(ConfigError, match="positive integer"):
        _backend(tmp_path, extra_args=["--tp-size=two"])
    with pytest.raises(ConfigError, match="pipeline, data and expert"):
        _backend(tmp_path, extra_args=["--tp-size", "2", "--dp-size", "2"])
    assert _backend(tmp_path).tp == 1 and _backend(tmp_path).kv == "arena"


def _entry(tensors: dict) -> str:
    from safetensors.torch import save

    return base64.b64encode(save(tensors)).decode()


def test_an_update_takes_one_entry_or_one_equal_entry_per_rank():
    from belayer_engine.weights.tensor import decode_named_tensors

    layout = {"w": [2, 3]}
    one = _entry({"w": torch.ones(2, 3, dtype=torch.bfloat16)})
    for entries in ([one], [one, one], [one] * 4):
        got = decode_named_tensors(entries, layout, "bfloat16")
        assert torch.equal(got["w"], torch.ones(2, 3, dtype=torch.bfloat16))
    other = _entry({"w": torch.zeros(2, 3, dtype=torch.bfloat16)})
    with pytest.raises(UsageError, match="entries differ"):
        decode_named_tensors([one, other], layout, "bfloat16")
    for bad in ([], [one] * 65, [one, 3], one):
        with pytest.raises(UsageError, match="a list of base64 strings"):
            decode_named_tensors(bad, layout, "bfloat16")
