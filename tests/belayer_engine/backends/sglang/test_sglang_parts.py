"""The SGLang backend's parts that need no SGLang server: layout, embedded model, launcher,
shm reaping. (The servers themselves: ``test_sglang_engine.py``.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from belayer_core.errors import ConfigError
from belayer_engine.backends.sglang import shm_files
from belayer_engine.backends.sglang.launcher import (
    SHIMS_DIR,
    SGLangServerConfig,
    server_argv,
    server_env,
)
from belayer_engine.backends.sglang.layout import SGLangWeights, padded_vocab, rotary_cache
from belayer_engine.backends.sglang.model_dir import (
    embedded_config,
    ensure_embedded_model,
    tokenizer_json,
)
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.tokenizer import ByteTokenizer
from belayer_engine.model.weights import init_weights


def test_layout_fuses_projections_and_updates_rows_in_place():
    cfg = embedded_config(vocab_size=500)  # padded to 512, as SGLang pads to 64
    hf = init_weights(cfg, seed=3)
    w = SGLangWeights(cfg)
    w.write(hf)
    qkv = w.tensors["model.layers.1.self_attn.qkv_proj.weight"]
    p = "model.layers.1.self_attn."
    assert torch.equal(qkv, torch.cat([hf[p + "q_proj.weight"], hf[p + "k_proj.weight"], hf[p + "v_proj.weight"]]))
    gate_up = w.tensors["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up[cfg.intermediate_size:], hf["model.layers.0.mlp.up_proj.weight"])
    assert w.tensors["lm_head.weight"].shape[0] == padded_vocab(cfg) == 512
    assert torch.equal(w.tensors["model.layers.3.self_attn.rotary_emb.cos_sin_cache"], rotary_cache(cfg))
    before = w.flat.data_ptr()
    w.write({p + "k_proj.weight": torch.zeros_like(hf[p + "k_proj.weight"])})
    assert w.flat.data_ptr() == before and not qkv[cfg.num_attention_heads * cfg.head_dim:][:64].any()
    storages = {t.untyped_storage().data_ptr() for t in w.tensors.values()}
    assert storages == {w.flat.untyped_storage().data_ptr(), w.rotary.untyped_storage().data_ptr()}


def test_tied_embeddings_are_one_tensor_under_both_names():
    w = SGLangWeights(ModelConfig())
    assert w.tensors["lm_head.weight"] is w.tensors["model.embed_tokens.weight"]


def test_embedded_model_is_cached_by_content_and_byte_compatible(tmp_path):
    first = ensure_embedded_model(root=tmp_path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedded_model(root=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime, "a cache hit writes nothing"
    assert ensure_embedded_model(seed=1, root=tmp_path) != first
    cfg = json.loads((first / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert ModelConfig.from_dir(first) == embedded_config()
    tok = tokenizer_json()
    byte = ByteTokenizer()
    vocab = tok["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(256)) and tok["model"]["merges"] == []
    assert {t["content"]: t["id"] for t in tok["added_tokens"]} == byte.special_ids


def test_server_command_is_cpu_safe_and_loopback(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    cfg = SGLangServerConfig(model_path="/m", port=30123, venv=str(venv), weight_cache_socket="/s.sock")
    argv = server_argv(cfg)
    assert argv[:3] == [str(venv / "bin" / "python"), "-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--host"] == "127.0.0.1" and "--skip-server-warmup" in argv
    assert argv[argv.index("--weight-cache-mode") + 1] == "client"
    env = server_env(cfg, base={"PYTHONPATH": "/project", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"})
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "", "a CPU server on a GPU machine would take SGLang's CUDA paths"
    assert not Path(env["SGLANG_NCCL_SO_PATH"]).exists(), "nor a NCCL communicator for its ranks"
    assert "--sleep-on-idle" in argv, "an idle scheduler does not spin a core"
    assert env["PYTHONPATH"] == str(SHIMS_DIR), "only the stand-ins, never the project's path"


def test_gc_reaps_sglang_shm_files_nobody_maps():
    path = shm_files.SHM_DIR / f"sglang_loads_belayertest_{os.getpid()}.shm"
    held = shm_files.SHM_DIR / f"sglang_loads_belayertest_{os.getpid()}_held.shm"
    path.write_bytes(b"x")
    held.write_bytes(b"x")
    with open(held, "rb"):
        orphans = shm_files.orphaned()
        assert path in orphans and held not in orphans
        assert str(path) in shm_files.reap_orphans()
    assert not path.exists() and held.exists()
    held.unlink()


def test_gc_reaps_multiprocessing_semaphores_nobody_maps():
    """A SIGKILLed SGLang group leaves its ranks' named semaphores behind (its resource
    tracker died with it); a semaphore some process still uses is mapped, and kept."""
    import multiprocessing

    lock = multiprocessing.get_context("spawn").Lock()  # named, mapped by this process
    live = [p for p in shm_files.SHM_DIR.glob("sem.mp-*") if p.stat().st_ino in shm_files._in_use()]
    assert live, "a spawn-context lock is a named semaphore this process maps"
    orphan = shm_files.SHM_DIR / f"sem.mp-belayertest{os.getpid()}"
    orphan.write_bytes(b"\0" * 32)
    orphans = shm_files.orphaned()
    assert orphan in orphans and not set(live) & set(orphans)
    assert str(orphan) in shm_files.reap_orphans() and not orphan.exists()
    assert all(p.exists() for p in live)
    del lock


def test_the_arena_accepts_the_sglang_backends_options(tmp_path):
    """The arena options the SGLang backend adds parse into a valid config of the arena program
    it names (the SGLang arena: the weight cache and, by default, the KV pool)."""
    import argparse

    from belayer_engine.backends.base import SlotSpec
    from belayer_engine.backends.sglang.arena import FLAGS, add_flags
    from belayer_engine.backends.sglang.backend import SGLangBackend

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    backend = SGLangBackend(str(tmp_path / "model"), venv=str(venv))
    slot = SlotSpec(name="w0", device="cpu", arena_socket=tmp_path / "a.sock", run_dir=tmp_path)
    p = argparse.ArgumentParser()
    add_flags(p)
    cfg = FLAGS.build(p.parse_args(["--socket", str(slot.arena_socket), *backend.arena_argv(slot)]))
    assert cfg.weight_cache_socket == backend.weight_cache_socket(slot) and cfg.model_dir == str(tmp_path / "model")
    assert backend.arena_module == "belayer_engine.backends.sglang.arena"
    assert cfg.kv_pool and cfg.kv_reserve_tokens == backend.kv_reserve_tokens == 512  # 1/64 of 4,096, at least 512


def _fake_venv(tmp_path, *packages: str) -> str:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    for name in packages:
        pkg = venv / "lib" / "python3.11" / "site-packages" / name
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
    return str(venv)


def test_shadow_memory_saver_only_where_it_can_work(tmp_path, monkeypatch):
    """On a GPU with torch_memory_saver in SGLang's env, only the shadow gets the saver
    (the serving worker keeps prefill graphs); impossible requests are errors, not ignored."""
    from belayer_engine.backends.base import SlotSpec, WorkerSpec
    from belayer_engine.backends.sglang.backend import SHADOW_PREFILL_GRAPH_TOKENS, SGLangBackend
    from belayer_engine.supervisor.config import SupervisorConfig

    monkeypatch.delenv("BELAYER_SGLANG_PYTHONPATH", raising=False)
    plain, saver = _fake_venv(tmp_path / "a"), _fake_venv(tmp_path / "b", "torch_memory_saver")
    assert not SGLangBackend("m", kv="server", venv=plain, device="cuda:0").shadow_memory_saver  # auto: absent -> off
    assert not SGLangBackend("m", kv="server", venv=saver, device="cpu").shadow_memory_saver  # auto: CPU -> off
    with pytest.raises(ConfigError, match="CUDA device"):
        SGLangBackend("m", kv="server", venv=saver, device="cpu", shadow_memory_saver=True)
    with pytest.raises(ConfigError, match="torch_memory_saver is not installed"):
        SGLangBackend("m", kv="server", venv=plain, device="cuda:0", shadow_memory_saver=True)
    with pytest.raises(ValueError, match="only apply to backend='sglang'"):
        SupervisorConfig(sglang_shadow_memory_saver=True)

    backend = SGLangBackend("m", kv="server", venv=saver, device="cuda:0")
    assert backend.shadow_memory_saver and backend.isolated_kv
    slot = SlotSpec(name="w0", device="cuda:0", arena_socket=tmp_path / "a.sock", run_dir=tmp_path)
    shadow = backend.worker_argv(slot, WorkerSpec(worker_id="s", host="127.0.0.1", port=9, shadow=True))
    worker = backend.worker_argv(slot, WorkerSpec(worker_id="w", host="127.0.0.1", port=8, shadow=False))
    assert "--memory-saver" in shadow and "--memory-saver" not in worker
    assert "--memory-saver-graphs" not in shadow and backend.releasable == ("kv_cache",)  # graphs stay resident
    assert shadow[shadow.index("--cuda-graph-max-bs-prefill") + 1] == str(SHADOW_PREFILL_GRAPH_TOKENS)  # small prefill graphs, shadow only
    assert "--cuda-graph-max-bs-prefill" not in worker
    own = SGLangBackend("m", ["--cuda-graph-max-bs-prefill", "64"], kv="server", venv=saver, device="cuda:0")
    argv = own.worker_argv(slot, WorkerSpec(worker_id="s", host="127.0.0.1", port=9, shadow=True))
    assert argv.count("--cuda-graph-max-bs-prefill") == 1 and argv[-1] == "64"  # the user's choice wins
    graphs_too = SGLangBackend("m", kv="server", venv=saver, device="cuda:0", shadow_release_graphs=True)
    assert graphs_too.releasable == ("kv_cache", "cuda_graph")
    assert "--memory-saver-graphs" in graphs_too.worker_argv(
        slot, WorkerSpec(worker_id="s", host="127.0.0.1", port=9, shadow=True))
    with pytest.raises(ConfigError, match="needs the shadow memory saver"):
        SGLangBackend("m", kv="server", venv=plain, device="cuda:0", shadow_release_graphs=True)

    on_gpu = SGLangServerConfig(model_path="m", port=9, device="cuda:0", venv=saver, memory_saver=True)
    argv, env = server_argv(on_gpu), server_env(on_gpu, base={})
    assert "--enable-memory-saver" in argv and "--disable-prefill-cuda-graph" not in argv
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in env  # graphs outside the saver: never released
    with_graphs = on_gpu.model_copy(update={"memory_saver_graphs": True})
    assert server_env(with_graphs, base={})["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"  # else the tag frees nothing
    assert "--disable-prefill-cuda-graph" in server_argv(with_graphs)  # not capturable under the graph hook
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        server_argv(SGLangServerConfig(model_path="m", port=9, device="cpu", venv=saver, memory_saver=True))


def test_cuda_stack_limit_reaches_gpu_servers_only(tmp_path, monkeypatch):
    from belayer_engine.backends.base import SlotSpec, WorkerSpec
    from belayer_engine.backends.sglang.backend import SGLangBackend
    from belayer_engine.backends.sglang.launcher import GPU_HOOKS_DIR
    from belayer_engine.supervisor.config import SupervisorConfig

    monkeypatch.delenv("BELAYER_SGLANG_PYTHONPATH", raising=False)
    venv = _fake_venv(tmp_path)
    gpu = SGLangServerConfig(model_path="m", port=9, device="cuda:0", venv=venv, cuda_stack_bytes=256)
    env = server_env(gpu, base={"PYTHONPATH": "/project"})
    assert env["BELAYER_CUDA_STACK_BYTES"] == "256" and env["PYTHONPATH"] == str(GPU_HOOKS_DIR)
    assert "BELAYER_CUDA_STACK_BYTES" not in server_env(gpu.model_copy(update={"cuda_stack_bytes": 0}), base={})
    with pytest.raises(ConfigError, match="cuda_stack_bytes=256 needs a CUDA device"):
        server_argv(gpu.model_copy(update={"device": "cpu"}))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        SGLangBackend("m", kv="server", venv=venv, device="cpu", cuda_stack_bytes=256)
    with pytest.raises(ValueError, match="sglang_cuda_stack_bytes only apply to backend='sglang'"):
        SupervisorConfig(sglang_cuda_stack_bytes=256)

    slot = SlotSpec(name="w0", device="cuda:0", arena_socket=tmp_path / "a.sock", run_dir=tmp_path)
    for shadow in (False, True):
        argv = SGLangBackend("m", kv="server", venv=venv, device="cuda:0", cuda_stack_bytes=512).worker_argv(
            slot, WorkerSpec(worker_id="w", host="127.0.0.1", port=8, shadow=shadow))
        assert argv[argv.index("--cuda-stack-bytes") + 1] == "512"
    from belayer_engine.backends.sglang.server import parse

    parsed = parse(["--model-path", "m", "--port", "9", "--device", "cuda:0", "--cuda-stack-bytes", "256",
                    "--cuda-graph-max-bs-prefill", "64"])
    assert parsed.cuda_stack_bytes == 256 and parsed.extra_args == ["--cuda-graph-max-bs-prefill", "64"]


def test_several_http_processes_per_server_are_refused_at_once(tmp_path, monkeypatch):
    """SGLang exits at start with --tokenizer-worker-num > 1 and the engine's --api-key, and
    keeps the weight version per HTTP process: refused with the reason, not a dead worker."""
    from belayer_engine.backends.sglang.backend import SGLangBackend

    monkeypatch.delenv("BELAYER_SGLANG_PYTHONPATH", raising=False)
    venv = _fake_venv(tmp_path)
    for flag in (["--tokenizer-worker-num", "4"], ["--tokenizer-worker-num=2"]):
        with pytest.raises(ConfigError, match="--tokenizer-worker-num: the engine runs one HTTP process"):
            SGLangBackend("m", flag, venv=venv, device="cuda:0")
    SGLangBackend("m", ["--tokenizer-worker-num", "1"], venv=venv, device="cpu")


def test_expandable_segments_on_gpu_servers_without_the_saver(tmp_path):
    """Torch's expandable segments reach a GPU server's environment unless the memory saver
    runs there (it releases only what cudaMalloc gave, which the segments bypass); the
    user's own allocator setting wins, and asking for both is an error naming the clash."""
    venv = _fake_venv(tmp_path)
    gpu = SGLangServerConfig(model_path="m", port=9, device="cuda:0", venv=venv)
    key = "PYTORCH_CUDA_ALLOC_CONF"
    assert server_env(gpu, base={})[key] == "expandable_segments:True"
    assert key not in server_env(gpu.model_copy(update={"memory_saver": True}), base={})
    assert key not in server_env(gpu.model_copy(update={"expandable_segments": False}), base={})
    assert server_env(gpu, base={key: "max_split_size_mb:64"})[key] == "max_split_size_mb:64"
    for tp in (["--tp-size", "2"], ["--tp=2"], ["--tensor-parallel-size", "4"]):  # several GPUs: not measured
        assert key not in server_env(gpu.model_copy(update={"extra_args": tp}), base={})
    assert server_env(gpu.model_copy(update={"extra_args": ["--tp-size", "1"]}), base={})[key]
    cpu = SGLangServerConfig(model_path="m", port=9, device="cpu", venv=venv)
    assert key not in server_env(cpu, base={})
    for bad in (gpu.model_copy(update={"memory_saver": True, "expandable_segments": True}),
                cpu.model_copy(update={"expandable_segments": True})):
        with pytest.raises(ConfigError, match="expandable_segments needs a CUDA device and no memory_saver"):
            server_argv(bad)


def test_small_cublas_workspace_on_one_gpu_servers(tmp_path):
    """An 8 MiB cuBLAS workspace reaches a one-GPU server (torch reads ":KiB:count"); 0
    leaves torch's default, the user's CUBLAS_WORKSPACE_CONFIG wins, several GPUs keep
    torch's, and sizes torch cannot express or a CPU server are errors."""
    venv = _fake_venv(tmp_path)
    gpu = SGLangServerConfig(model_path="m", port=9, device="cuda:0", venv=venv)
    key = "CUBLAS_WORKSPACE_CONFIG"
    assert server_env(gpu, base={})[key] == ":4096:2"
    assert server_env(gpu.model_copy(update={"memory_saver": True}), base={})[key] == ":4096:2"
    assert server_env(gpu.model_copy(update={"cublas_workspace_mib": 16}), base={})[key] == ":4096:4"
    assert key not in server_env(gpu.model_copy(update={"cublas_workspace_mib": 0}), base={})
    assert server_env(gpu, base={key: ":16:8"})[key] == ":16:8"
    assert key not in server_env(gpu.model_copy(update={"extra_args": ["--tp", "2"]}), base={})
    cpu = SGLangServerConfig(model_path="m", port=9, device="cpu", venv=venv)
    assert key not in server_env(cpu, base={})
    with pytest.raises(ConfigError, match="cublas_workspace_mib=8 needs a CUDA device"):
        server_argv(cpu.model_copy(update={"cublas_workspace_mib": 8}))
    with pytest.raises(ValueError, match="multiple of 4"):
        SGLangServerConfig(model_path="m", port=9, cublas_workspace_mib=6)


def test_a_small_kv_pool_stays_resident_in_the_shadow(tmp_path, monkeypatch):
    """Where the saver could release a shadow's KV, a pool of at most RESIDENT_KV_MIB stays
    resident instead (promotion then resumes nothing): the 4B shape at the engine's 4,096
    tokens is 576 MiB; at 65,536 tokens (9 GiB) the saver releases it; asked for, it runs."""
    import json

    from belayer_engine.backends.sglang.backend import RESIDENT_KV_MIB, SGLangBackend
    from belayer_engine.backends.sglang.sizing import kv_pool_mib

    monkeypatch.delenv("BELAYER_SGLANG_PYTHONPATH", raising=False)
    saver = _fake_venv(tmp_path, "torch_memory_saver")
    model = tmp_path / "qwen3-4b-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 2560, "torch_dtype": "bfloat16"}))
    assert kv_pool_mib(str(model), []) == 576 <= RESIDENT_KV_MIB
    assert kv_pool_mib(str(model), ["--max-total-tokens", "8192", "--max-total-tokens=65536"]) == 9216
    assert kv_pool_mib(str(tmp_path / "nowhere"), []) is None
    assert not SGLangBackend(str(model), kv="server", venv=saver, device="cuda:0").shadow_memory_saver
    assert SGLangBackend(str(model), ["--max-total-tokens", "65536"], kv="server", venv=saver, device="cuda:0").shadow_memory_saver
    assert SGLangBackend(str(model), kv="server", venv=saver, device="cuda:0", shadow_memory_saver=True).shadow_memory_saver
    assert SGLangBackend("m", kv="server", venv=saver, device="cuda:0").shadow_memory_saver  # pool unknown: released


def test_memory_saver_never_runs_with_inherited_expandable_segments(tmp_path, monkeypatch):
    """A trainer's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would leave a saver
    shadow releasing nothing: where the saver is automatic the shadow keeps its KV instead,
    where it was asked for (or a server is started with it) the clash is an error."""
    from belayer_engine.backends.sglang.backend import SGLangBackend

    monkeypatch.delenv("BELAYER_SGLANG_PYTHONPATH", raising=False)
    saver = _fake_venv(tmp_path, "torch_memory_saver")
    for var, value in (("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True"),
                       ("PYTORCH_ALLOC_CONF", "expandable_segments:true")):
        monkeypatch.setenv(var, value)
        assert not SGLangBackend("m", kv="server", venv=saver, device="cuda:0").shadow_memory_saver
        with pytest.raises(ConfigError, match=f"{var}=.*expandable"):
            SGLangBackend("m", kv="server", venv=saver, device="cuda:0", shadow_memory_saver=True)
        on_gpu = SGLangServerConfig(model_path="m", port=9, device="cuda:0", venv=saver, memory_saver=True)
        with pytest.raises(ConfigError, match=f"memory_saver releases only what cudaMalloc gave, and {var}="):
            server_env(on_gpu, base={var: value})
        monkeypatch.delenv(var)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert SGLangBackend("m", kv="server", venv=saver, device="cuda:0").shadow_memory_saver


def test_cuda_stack_hook_wraps_the_real_sglang_scheduler():
    """The hook, in SGLang's own interpreter, wraps the Scheduler class SGLang imports and
    the scheduler's torch.cuda.set_device (the CUDA calls themselves need a GPU:
    benchmarks/sglang_server_memory.py runs them on one and compares greedy ids)."""
    import subprocess

    from belayer_engine.backends.sglang.launcher import GPU_HOOKS_DIR, venv_python
    from tests.belayer_engine.backends.sglang.conftest import sglang_venv

    cpu_env = server_env(SGLangServerConfig(model_path="m", port=9, venv=sglang_venv()))
    env = {**cpu_env, "BELAYER_CUDA_STACK_BYTES": "256",
           "PYTHONPATH": os.pathsep.join([str(GPU_HOOKS_DIR), cpu_env.get("PYTHONPATH", "")])}
    probe = ("import sys\n"  # the CPU shims' own sitecustomize ran too (ours runs the next one)
             "assert not any(p.endswith('cpu_shims') for p in sys.path) or "
             "any(type(f).__name__ == '_DeclareTorchvisionOps' for f in sys.meta_path)\n"
             "from sglang.srt.managers.scheduler import Scheduler\n"
             "import torch, sitecustomize\n"
             "print(Scheduler.__init__.__qualname__, torch.cuda.set_device.__name__)\n"
             "assert sitecustomize._stack_limit(256) is None  # no CUDA context: a no-op\n")
    out = subprocess.run([str(venv_python(sglang_venv())), "-c", probe], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "_install.<locals>.__init__ set_device_then_lower", out.stdout
