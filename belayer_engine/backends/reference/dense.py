"""A plain PyTorch decoder: dense, no KV cache, no paging, no batching.

Each step recomputes the whole sequence. It exists so tests can check the paged,
continuously batched, arena-backed worker against the simplest possible forward pass over
the same weights and the same numeric primitives.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from belayer_engine.backends.reference import ops
from belayer_engine.model.config import ModelConfig


@torch.inference_mode()
def dense_logits(cfg: ModelConfig, w: Mapping[str, torch.Tensor], ids: list[int],
                 exact: bool = True) -> torch.Tensor:
    """Logits (vocab,) of the last position of ``ids``."""
    n, hq, d = len(ids), cfg.num_attention_heads, cfg.head_dim
    cos, sin = ops.rope_tables(d, cfg.max_position_embeddings, cfg.rope_theta, "cpu")
    cos, sin = cos[:n], sin[:n]
    scale = d ** -0.5
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg.num_hidden_layers):
        q, k, v = ops.layer_qkv(cfg, w, i, x, cos, sin, exact)
        attn = ops.attend_rows(q, k, v, 0, scale) if exact else ops.attend_causal(q, k, v, scale)
        x = ops.layer_out_mlp(cfg, w, i, x, attn.reshape(n, hq * d), exact)
    h = ops.rms_norm(x[-1:], w["model.norm.weight"], cfg.rms_norm_eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return ops.linear(h, head, exact).float()[0]


def greedy_generate(cfg: ModelConfig, w: Mapping[str, torch.Tensor], prompt: list[int],
                    max_new_tokens: int, exact: bool = True) -> list[int]:
    """Greedy tokens by full recomputation (no stop conditions)."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(torch.argmax(dense_logits(cfg, w, ids, exact)))
        out.append(tok)
        ids.append(tok)
    return out
