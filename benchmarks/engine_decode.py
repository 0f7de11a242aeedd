"""What decode throughput does the arena engine give, against a plain PyTorch loop?

Decode: tokens/s of the arena-backed engine path (the reference worker's model over a paged
KV cache: CUDA graphs on GPU, and eager beside them; exact eager on CPU) vs a plain PyTorch
loop (dense contiguous KV cache, batched linears, no graphs), per batch size, after a
prompt of 64 tokens. The plain loop runs twice: its first pass pays per-shape kernel
set-up. The model: random weights of the Qwen3-4B shape in bf16 (``_random_model.py``), or
the embedded small model with ``--small``.

    python benchmarks/engine_decode.py --device cuda:0            # Qwen3-4B shape, bf16
    python benchmarks/engine_decode.py --device cpu --small       # quick, exercises all
Writes benchmarks/results/engine_decode-<device>.json and a .png plot (if matplotlib).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._plotting import pyplot, save_result  # noqa: E402
from benchmarks._random_model import prepared, sync  # noqa: E402


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
    sync(dev)
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
    sync(dev)
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
    sync(dev)
    return b * steps / (time.time() - t)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 4))
    bs = [r["batch"] for r in result["decode"]]
    ax.plot(bs, [r["engine_tok_s"] for r in result["decode"]], "o-",
            label="arena engine (CUDA graphs)" if "cuda" in result["device"] else "arena engine")
    if "cuda" in result["device"]:
        ax.plot(bs, [r["engine_eager_tok_s"] for r in result["decode"]], "^:", label="arena engine, eager")
    ax.plot(bs, [r["plain_tok_s"] for r in result["decode"]], "s--", label="plain PyTorch loop")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"decode ({result['device']}, {result['model']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--small", action="store_true", help="embedded small model (CPU smoke run)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--batches", default=None, help="decode batch sizes, e.g. 1,8,32")
    p.add_argument("--steps", type=int, default=None, help="decode steps per batch size")
    p.add_argument("--workdir", default=None, help="where the random model dir is written")
    a = p.parse_args()
    batches = [int(x) for x in (a.batches or ("1,4,8" if a.small else "1,8,32,64")).split(",")]
    steps = a.steps or (16 if a.small else 128)
    model_dir = prepared(a.workdir, a.small, a.device)
    result = {"device": a.device, "model": "small" if a.small else "qwen3-4b-shape-bf16",
              "decode": decode_bench(str(model_dir), a.device, batches, steps, prompt_len=64)}
    stem = f"engine_decode-{a.device.replace(':', '')}{'-small' if a.small else ''}"
    save_result(result, Path(a.out) / f"{stem}.json", plot)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
