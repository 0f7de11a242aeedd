"""Numeric primitives of the decoder, in two flavours.

``exact=True`` (the CPU default) makes every token row's result independent of which other
rows share the call: matrix products run in tiles of exactly ``TILE_ROWS`` rows (padded
with zeros; a row's bits depend neither on its place in the tile nor on its neighbours:
``tests/belayer_engine/backends/reference/test_exact_ops.py`` checks that on the machine
that runs it), and attention is computed per query row over exactly the keys it may see,
with shapes that depend only on that row's position. Token-level continuation in the
router relies on this: a request gives bit-identical greedy tokens alone, batched in any
composition, or re-prefilled from ``prompt + generated[:i]``.
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


TILE_ROWS = 16
"""Rows per matrix product on the exact path. One row per call (a GEMV) reads the whole
weight matrix per row; a fixed tile reads it once per 16 rows (about 5x faster prefill on
2 CPU cores) and keeps the call shape fixed, so a row's bits never depend on the batch."""


def linear(x: torch.Tensor, weight: torch.Tensor, exact: bool) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` of shape (n, in); in fixed tiles of ``TILE_ROWS`` rows when ``exact``.

    Every exact call multiplies a contiguous, 64-byte aligned (``TILE_ROWS``, in) block (rows
    past the last one zero-padded), so a row's result never depends on how many rows, or
    which, were batched with it. ``pad_rows`` gives rows that need no copy here.
    """
    if not exact:
        return F.linear(x, weight)
    n = x.shape[0]
    if n % TILE_ROWS or not x.is_contiguous() or x.data_ptr() % 64:
        x = pad_rows(x)
    out = x.new_empty(x.shape[0], weight.shape[0])
    for a in range(0, x.shape[0], TILE_ROWS):
        torch.mm(x[a : a + TILE_ROWS], weight.t(), out=out[a : a + TILE_ROWS])
    return out[:n]


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` (n, ...) in a fresh tensor whose row count is a multiple of ``TILE_ROWS`` (zero rows
    after the last): the exact path's products then run on it without copying."""
    n = x.shape[0]
    padded = x.new_zeros((-(-n // TILE_ROWS) * TILE_ROWS, *x.shape[1:]))
    padded[:n] = x
    return padded


def layer_qkv(cfg, w, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              exact: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s q (n, Hq, d) and k, v (n, Hkv, d) for rows ``x``: input RMSNorm,
    projections, Qwen3's per-head q/k RMSNorm, RoPE. One definition serves the worker, its
    CUDA-graph paths and the dense reference, so they differ only in attention and caching."""
    p = f"model.layers.{layer}."
    n, hq, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
    q = linear(h, w[p + "self_attn.q_proj.weight"], exact).view(n, hq, d)
    k = linear(h, w[p + "self_attn.k_proj.weight"], exact).view(n, hkv, d)
    v = linear(h, w[p + "self_attn.v_proj.weight"], exact).view(n, hkv, d)
    if cfg.qk_norm:
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def layer_out_mlp(cfg, w, layer: int, x: torch.Tensor, attn: torch.Tensor, exact: bool) -> torch.Tensor:
    """``x`` plus layer ``layer``'s output projection of ``attn`` (n, Hq * d), then plus its
    SwiGLU MLP."""
    p = f"model.layers.{layer}."
    x = x + linear(attn, w[p + "self_attn.o_proj.weight"], exact)
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    gate = linear(h, w[p + "mlp.gate_proj.weight"], exact)
    up = linear(h, w[p + "mlp.up_proj.weight"], exact)
    return x + linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"], exact)


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


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float) -> torch.Tensor:
    """Attention of query rows q (m, H, d) at positions ``first`` .. ``first + m - 1`` of one
    sequence over its keys/values k, v (>= first + m, Hkv, d) -> (m, H, d), row by row.

    Each row attends over exactly its L = position + 1 keys, in a call whose shapes depend
    only on L, never on the batch, so prefill and decode of the same position compute
    identical bits. The query heads of a key/value head are that head's queries (no
    repeated copy of the keys).
    """
    m, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().reshape(m, 1, hkv, hq // hkv, d)
    kt, vt = k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None]  # (1, Hkv, ctx, d)
    out = torch.empty(qg.shape, dtype=torch.float32, device=q.device)
    for r in range(m):
        L = first + r + 1
        out[r] = F.scaled_dot_product_attention(qg[r], kt[:, :, :L], vt[:, :, :L], scale=scale)
    return out.reshape(m, hq, d).to(q.dtype)


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Fast path: causal attention of the last q rows (n, H, d) over k, v (L, Hkv, d)."""
    n, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(diagonal=L - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def no_cudnn_attention():
    """Context: SDPA may use flash, memory-efficient or math kernels, not cuDNN (which
    builds an execution plan per new shape; the eager path sees a new shape per length)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class RaggedAttention:
    """Fast-path attention of a ragged batch: at most two SDPA calls per layer, no Python
    loop over sequences and no host-device copy inside the layer loop.

    ``seqs``: (start, end, ctx_len, block_table) per sequence, rows [start, end) of the
    batch at positions ``ctx_len - (end - start)`` .. ``ctx_len - 1``. Two groups:

    - *fresh* sequences (a whole prompt, ``end - start == ctx_len``) attend over their own
      new K/V: right-padded to the longest, one causal call (padding rows repeat the last
      real row and are dropped; real rows never see a padding key, which lies after them);
    - sequences with earlier context (decode rows) attend over keys gathered from the paged
      cache through their block tables, with a mask (key position <= row position).

    Everything the layers share (row gathers, block tables, masks) is built once, on the
    host, and copied to the device once.
    """

    def __init__(self, seqs: list[tuple[int, int, int, list[int]]], positions: torch.Tensor,
                 block_size: int, device: torch.device):
        pos = positions.tolist()
        fresh = [s for s in seqs if s[1] - s[0] == s[2]]
        cached = [s for s in seqs if s[1] - s[0] != s[2]]
        self.rows = sum(e - b for b, e, _, _ in seqs)
        self.groups = []
        for group, paged in ((fresh, False), (cached, True)):
            if not group:
                continue
            n = max(e - b for b, e, _, _ in group)
            gather, sel, dest, qpos, tables = [], [], [], [], []
            nblk = max(-(-c // block_size) for _, _, c, _ in group) if paged else 0
            for g, (b, e, c, table) in enumerate(group):
                rows = list(range(b, e)) + [e - 1] * (n - (e - b))
                gather += rows
                sel += range(g * n, g * n + e - b)
                dest += range(b, e)
                qpos.append([pos[r] for r in rows])
                if paged:
                    used = list(table[: -(-c // block_size)])
                    tables.append(used + [used[0]] * (nblk - len(used)))
            ident = gather == list(range(self.rows)) and sel == gather

            def as_dev(xs: list) -> torch.Tensor:
                return torch.tensor(xs, dtype=torch.long).to(device, non_blocking=True)

            entry = {"g": len(group), "n": n, "ident": ident,
                     "gather": None if ident else as_dev(gather),
                     "sel": None if ident else as_dev(sel), "dest": None if ident else as_dev(dest)}
            if paged:
                span = nblk * block_size
                q_at = torch.tensor(qpos, dtype=torch.long)
                mask = torch.arange(span)[None, None, :] <= q_at[:, :, None]
                entry.update(tables=as_dev(tables), span=span,
                             mask=mask[:, None].to(device, non_blocking=True))
            self.groups.append(entry)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q (rows, H, d), this call's k, v (rows, Hkv, d), caches (blocks, bs, Hkv, d)."""
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        out = None
        for grp in self.groups:
            g, n = grp["g"], grp["n"]
            if "tables" in grp:
                kc = k_cache[grp["tables"]].view(g, grp["span"], hkv, d).transpose(1, 2)
                vc = v_cache[grp["tables"]].view(g, grp["span"], hkv, d).transpose(1, 2)
                o = F.scaled_dot_product_attention(_padded(q, grp), kc.to(q.dtype), vc.to(q.dtype),
                                                   attn_mask=grp["mask"], scale=scale,
                                                   enable_gqa=hq != hkv)
            else:
                o = F.scaled_dot_product_attention(_padded(q, grp), _padded(k, grp), _padded(v, grp), is_causal=True,
                                                   scale=scale, enable_gqa=hq != hkv)
            o = o.transpose(1, 2).reshape(g * n, hq, d)
            if grp["ident"]:  # the group is the whole batch, in row order, unpadded
                return o
            out = torch.empty_like(q) if out is None else out
            out.index_copy_(0, grp["dest"], o.index_select(0, grp["sel"]))
        return out


def _padded(x: torch.Tensor, grp: dict) -> torch.Tensor:
    """Rows (rows, heads, d) of one RaggedAttention group as (g, heads, n, d)."""
    x = x if grp["ident"] else x.index_select(0, grp["gather"])
    return x.view(grp["g"], grp["n"], x.shape[1], x.shape[2]).transpose(1, 2)
