"""Worker cold start vs attaching to a live arena, and decode throughput.

Cold start: a fresh process imports torch, inits the device, loads safetensors onto it,
allocates its KV, captures decode graphs (CUDA) and emits the first token. Attach: a fresh
process maps a live arena's weights and KV instead. Handover: a pre-initialized shadow
(arena mapped, graphs captured on scratch blocks) is activated and emits a first token.
Decode: tokens/s of the arena-backed engine path (CUDA graphs on GPU; exact eager on CPU)
vs a plain PyTorch loop (dense contiguous KV cache, batched linears, no graphs).

    python benchmarks/engine_coldstart.py --device cuda:0            # Qwen3-4B shape, bf16
    python benchmarks/engine_coldstart.py --device cpu --small       # quick, exercises all
Writes benchmarks/results/engine_coldstart-<device>.json and a .png plot (if matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_SPAWN = time.time()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._plotting import save_result  # noqa: E402


def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def random_model_dir(path: Path, small: bool, device: str) -> None:
    """Random weights of the chosen shape, written as an HF-layout safetensors dir."""
    import torch

    from belayer_engine.model.config import ModelConfig
    from belayer_engine.model.weights import init_weights, save_safetensors_dir, weight_specs

    cfg = ModelConfig() if small else ModelConfig.qwen3_4b()
    if small:
        weights = init_weights(cfg, 0)
    else:  # generate on the device: 4.4 B params on CPU would dominate the run
        gen = torch.Generator(device=device).manual_seed(0)
        weights = {}
        for name, shape in weight_specs(cfg).items():
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            t = 1.0 + 0.1 * t if len(shape) == 1 else t * (shape[-1] ** -0.5)
            weights[name] = t.to(torch.bfloat16)
    save_safetensors_dir(path, cfg, weights)


# --------------------------------------------------------------------- child processes
def child_cold(model_dir: str, device: str, num_blocks: int, block_size: int, t_spawn: float):
    marks = {}
    t0 = time.time()
    import torch

    marks["import_torch_s"] = time.time() - t0
    from belayer_engine.backends.reference.graphs import GraphRunner
    from belayer_engine.backends.reference.model import Qwen3Model, SeqBatch
    from belayer_engine.model.config import ModelConfig, kv_shape
    from belayer_engine.model.weights import load_safetensors_dir, torch_dtype

    t = time.time()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.init()
        torch.zeros(1, device=dev)
    marks["device_init_s"] = time.time() - t
    t = time.time()
    cfg = ModelConfig.from_dir(model_dir)
    w = {k: v.to(dev) for k, v in load_safetensors_dir(model_dir, cfg).items()}
    _sync(dev)
    marks["load_weights_s"] = time.time() - t
    t = time.time()
    kv = torch.zeros(kv_shape(cfg, num_blocks + 1, block_size), dtype=torch_dtype(cfg.dtype),
                     device=dev)
    model = Qwen3Model(cfg, w, exact=dev.type == "cpu", device=dev)
    _sync(dev)
    marks["alloc_kv_s"] = time.time() - t
    t = time.time()
    if dev.type == "cuda":
        GraphRunner(model, kv, 2048 // block_size, num_blocks).capture()
    marks["graphs_s"] = time.time() - t
    t = time.time()
    prompt = list(range(1, 17))
    logits = model.forward(torch.tensor(prompt), torch.arange(16), [SeqBatch(0, 16, 16, [0])], kv)
    int(logits[0].argmax())
    marks["first_token_s"] = time.time() - t
    marks["total_s"] = time.time() - t_spawn
    return marks


def child_attach(socket: str, t_spawn: float):
    """A fresh process attaches to the live arena (cold process, warm memory)."""
    marks = {}
    t0 = time.time()
    import torch  # noqa: F401

    marks["import_torch_s"] = time.time() - t0
    from belayer_engine.backends.reference.state import WorkerState

    t = time.time()
    rt = WorkerState(socket, "bench-attach", shadow=True)
    marks["attach_and_graphs_s"] = time.time() - t
    marks.update(_activate_first_token(rt))
    marks["total_s"] = time.time() - t_spawn
    return marks


def child_shadow(socket: str, t_spawn: float):
    """Pre-initialized shadow: only activation + first token are on the critical path."""
    from belayer_engine.backends.reference.state import WorkerState

    rt = WorkerState(socket, "bench-shadow", shadow=True)
    return {"shadow_init_s": time.time() - t_spawn, **_activate_first_token(rt)}


def _activate_first_token(rt) -> dict:
    import threading

    from belayer_engine.backends.reference.sampling import SamplingParams
    from belayer_engine.backends.reference.scheduler import Request

    t = time.time()
    rt.activate()
    marks = {"activate_s": time.time() - t}
    done = threading.Event()
    rt.scheduler.submit(Request("b", list(range(1, 17)), SamplingParams(max_new_tokens=1,
                     temperature=0.0), lambda ev: ev["finish_reason"] and done.set()))
    done.wait(120)
    marks["handover_first_token_s"] = time.time() - t
    rt.close()
    return marks


# --------------------------------------------------------------------- decode throughput
def decode_bench(model_dir: str, device: str, batches: list[int], steps: int, prompt_len: int):
    import torch

    from belayer_engine.backends.reference.graphs import GraphRunner
    from belayer_engine.backends.reference.model import Qwen3Model, SeqBatch
    from belayer_engine.model.config import ModelConfig, kv_shape
    from belayer_engine.model.weights import load_safetensors_dir, torch_dtype

    dev = torch.device(device)
    cfg = ModelConfig.from_dir(model_dir)
    w = {k: v.to(dev) for k, v in load_safetensors_dir(model_dir, cfg).items()}
    dtype, bs = torch_dtype(cfg.dtype), 16
    per_seq = -(-(prompt_len + steps + 1) // bs)
    results = []
    for b in batches:
        kv = torch.zeros(kv_shape(cfg, b * per_seq + 1, bs), dtype=dtype, device=dev)
        model = Qwen3Model(cfg, w, exact=dev.type == "cpu", device=dev)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
        ids = torch.randint(0, cfg.vocab_size, (b * prompt_len,))
        seqs = [SeqBatch(i * prompt_len, (i + 1) * prompt_len, prompt_len, tables[i])
                for i in range(b)]
        model.forward(ids, torch.arange(prompt_len).repeat(b), seqs, kv)
        graphs = None
        if dev.type == "cuda":
            graphs = GraphRunner(model, kv, per_seq, b * per_seq, sizes=(b,))
            graphs.capture()
        run = (model, kv, tables, b, steps, prompt_len, dev)
        engine_tps = engine_pass(*run, graphs)
        eager_tps = engine_pass(*run, None) if graphs is not None else engine_tps

        plain_cold_tps = plain_loop(cfg, w, b, steps, prompt_len, dev)  # pays kernel set-up
        plain_tps = plain_loop(cfg, w, b, steps, prompt_len, dev)
        results.append({"batch": b, "engine_tok_s": engine_tps, "engine_eager_tok_s": eager_tps,
                        "plain_tok_s": plain_tps,
                        "plain_first_pass_tok_s": plain_cold_tps})
        print(json.dumps(results[-1]), flush=True)
        del kv
    return results


def engine_pass(model, kv, tables, b, steps, prompt_len, dev, graphs) -> float:
    """Decode tokens/s of the arena engine's path (graph replay when ``graphs``)."""
    import torch

    from belayer_engine.backends.reference.model import SeqBatch

    toks = [1] * b
    _sync(dev)
    t = time.time()
    for s in range(steps):
        ctx = prompt_len + s + 1
        if graphs is not None:
            logits = graphs.run(toks, [ctx - 1] * b, tables, [ctx] * b)
        else:
            logits = model.forward(torch.tensor(toks), torch.full((b,), ctx - 1),
                                   [SeqBatch(i, i + 1, ctx, tables[i]) for i in range(b)], kv)
        toks = logits.argmax(-1).tolist()
    return b * steps / (time.time() - t)


def plain_loop(cfg, w, b: int, steps: int, prompt_len: int, dev) -> float:
    """Decode tokens/s of a plain eager loop: contiguous per-layer cache (b, kv_heads, T, d),
    batched ops, no paging, no graphs."""
    import torch
    import torch.nn.functional as F

    from belayer_engine.backends.reference import ops

    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = prompt_len + steps + 1
    dtype = w["model.norm.weight"].dtype
    kc = torch.zeros(cfg.num_hidden_layers, 2, b, hkv, T, d, dtype=dtype, device=dev)
    cos, sin = ops.rope_tables(d, T, cfg.rope_theta, dev)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    eps = cfg.rms_norm_eps
    _sync(dev)
    t = time.time()
    tok = torch.ones(b, dtype=torch.long, device=dev)
    with torch.inference_mode():
        for s in range(steps):
            p = prompt_len + s
            c, sn = cos[p : p + 1].expand(b, d), sin[p : p + 1].expand(b, d)
            x = w["model.embed_tokens.weight"][tok]
            for i in range(cfg.num_hidden_layers):
                pre = f"model.layers.{i}."
                h = ops.rms_norm(x, w[pre + "input_layernorm.weight"], eps)
                q = F.linear(h, w[pre + "self_attn.q_proj.weight"]).view(b, hq, d)
                k = F.linear(h, w[pre + "self_attn.k_proj.weight"]).view(b, hkv, d)
                v = F.linear(h, w[pre + "self_attn.v_proj.weight"]).view(b, hkv, d)
                if cfg.qk_norm:
                    q = ops.rms_norm(q, w[pre + "self_attn.q_norm.weight"], eps)
                    k = ops.rms_norm(k, w[pre + "self_attn.k_norm.weight"], eps)
                q, k = ops.apply_rope(q, c, sn), ops.apply_rope(k, c, sn)
                kc[i, 0, :, :, p], kc[i, 1, :, :, p] = k, v
                a = F.scaled_dot_product_attention(q[:, :, None], kc[i, 0, :, :, : p + 1],
                                                   kc[i, 1, :, :, : p + 1], enable_gqa=hq != hkv)
                x = x + F.linear(a.reshape(b, hq * d), w[pre + "self_attn.o_proj.weight"])
                h = ops.rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps)
                x = x + F.linear(F.silu(F.linear(h, w[pre + "mlp.gate_proj.weight"]))
                                 * F.linear(h, w[pre + "mlp.up_proj.weight"]),
                                 w[pre + "mlp.down_proj.weight"])
            tok = F.linear(ops.rms_norm(x, w["model.norm.weight"], eps), head).argmax(-1)
    _sync(dev)
    return b * steps / (time.time() - t)


# --------------------------------------------------------------------- driver
def run_child(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t = time.time()
    out = subprocess.run([sys.executable, __file__, "--child", *args, "--t-spawn", str(t)],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_arena(model_dir: str, device: str, sock: str, num_blocks: int, block_size: int):
    from belayer_engine.arena.client import ArenaClient

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "belayer_engine.arena", "--socket", sock,
                             "--device", device, "--model-dir", model_dir, "--num-blocks",
                             str(num_blocks), "--block-size", str(block_size)], env=env)
    ArenaClient(sock).wait_ready(600)
    return proc


def plot(result: dict, path: Path) -> None:
    from _plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["cold start", "attach (fresh process)", "shadow handover"]
    vals = [result["cold"]["total_s"], result["attach"]["total_s"],
            result["shadow"]["handover_first_token_s"]]
    a1.bar(names, vals, color=["#c44", "#e93", "#3a6"])
    a1.set_ylabel("seconds to first token")
    a1.set_title(f"worker start ({result['device']}, {result['model']})")
    for i, v in enumerate(vals):
        a1.text(i, v, f"{v:.3g}s", ha="center", va="bottom")
    bs = [r["batch"] for r in result["decode"]]
    a2.plot(bs, [r["engine_tok_s"] for r in result["decode"]], "o-",
            label="arena engine (CUDA graphs)" if "cuda" in result["device"] else "arena engine")
    if "cuda" in result["device"]:
        a2.plot(bs, [r["engine_eager_tok_s"] for r in result["decode"]], "^:",
                label="arena engine, eager")
    a2.plot(bs, [r["plain_tok_s"] for r in result["decode"]], "s--", label="plain PyTorch loop")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("batch")
    a2.set_ylabel("decode tokens/s")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--small", action="store_true", help="embedded small model (CPU smoke run)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--batches", default=None, help="decode batch sizes, e.g. 1,8,32")
    p.add_argument("--steps", type=int, default=None, help="decode steps per batch size")
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--workdir", default=None, help="where the random model dir is written")
    p.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    p.add_argument("--t-spawn", type=float, default=T_SPAWN, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        kind, rest = a.child[0], a.child[1:]
        if kind == "cold":
            res = child_cold(rest[0], rest[1], int(rest[2]), int(rest[3]), a.t_spawn)
        elif kind == "attach":
            res = child_attach(rest[0], a.t_spawn)
        else:
            res = child_shadow(rest[0], a.t_spawn)
        print(json.dumps(res), flush=True)
        return 0

    small = a.small
    batches = [int(x) for x in (a.batches or ("1,4,8" if small else "1,8,32,64")).split(",")]
    steps = a.steps or (16 if small else 128)
    num_blocks = a.num_blocks or (256 if small else 4096)
    block_size = 16
    work = Path(a.workdir or tempfile.mkdtemp(prefix="belayer-bench-"))
    model_dir = work / "model"
    t = time.time()
    if not (model_dir / "config.json").exists():
        random_model_dir(model_dir, small, a.device)
    print(f"model dir ready in {time.time() - t:.1f}s", flush=True)
    result = {"device": a.device, "model": "small" if small else "qwen3-4b-shape-bf16"}
    result["cold"] = run_child(["cold", str(model_dir), a.device, str(num_blocks), str(block_size)])
    print("cold", result["cold"], flush=True)
    sock = str(work / "arena.sock")
    arena = start_arena(str(model_dir), a.device, sock, num_blocks, block_size)
    try:
        result["attach"] = run_child(["attach", sock])
        print("attach", result["attach"], flush=True)
        result["shadow"] = run_child(["shadow", sock])
        print("shadow", result["shadow"], flush=True)
    finally:
        arena.terminate()
        arena.wait(60)
    result["decode"] = decode_bench(str(model_dir), a.device, batches, steps, prompt_len=64)
    stem = f"engine_coldstart-{a.device.replace(':', '')}{'-small' if small else ''}"
    save_result(result, Path(a.out) / f"{stem}.json", plot)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
