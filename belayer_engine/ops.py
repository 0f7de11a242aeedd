"""Numeric primitives of the decoder, in two flavours.

``exact=True`` (the CPU default) makes every token row's result independent of which other
rows share the call: matrix products run one row at a time with identical shapes, and
attention is computed per query row over exactly the keys it may see. Token-level
continuation in the router relies on this: a request gives bit-identical greedy tokens
alone, batched in any composition, or re-prefilled from ``prompt + generated[:i]``.
``exact=False`` batches the products (the fast path for CUDA) and promises closeness only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (Qwen3 style)."""
    dtype = x.dtype
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(dtype) * weight


def linear(x: torch.Tensor, weight: torch.Tensor, exact: bool) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` of shape (n, in); row by row when ``exact``.

    One row at a time keeps the BLAS call shape fixed at (1, in) so a row's result never
    depends on how many rows were batched with it.
    """
    if not exact or x.shape[0] == 1:
        return F.linear(x, weight)
    return torch.cat([F.linear(x[i : i + 1].clone(), weight) for i in range(x.shape[0])])


def rope_tables(head_dim: int, max_pos: int, theta: float, device, dtype=torch.float32):
    """cos/sin tables (max_pos, head_dim), computed once so every lookup is exact."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE for x (n, heads, d) with per-row cos/sin (n, d); elementwise only."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None, :].to(x.dtype)) + (rot * sin[:, None, :].to(x.dtype))


def attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query row q (H, d) over keys/values k, v (L, Hkv, d) -> (H, d).

    Shapes depend only on L (the row's position + 1), never on the batch, so prefill and
    decode of the same position compute identical bits.
    """
    group = q.shape[0] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = (k.float() * q.float()).sum(-1)  # (L, H)
    probs = torch.softmax(scores.t().contiguous() * scale, dim=-1)  # (H, L)
    out = (probs.t()[:, :, None] * v.float()).sum(0)  # (H, d)
    return out.to(q.dtype)


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Fast path: causal attention of the last q rows (n, H, d) over k, v (L, Hkv, d)."""
    n, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(diagonal=L - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)
