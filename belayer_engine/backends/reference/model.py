"""Qwen3-style decoder forward pass over a paged KV cache.

The model holds no parameters of its own: it reads a ``name -> tensor`` mapping (views
into the arena's weight slot) and a KV tensor (a view into the arena's KV memory). A
batch is a ragged list of sequences; each contributes consecutive rows (a prefill chunk
or one decode token), so prefill and decode mix freely in one call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from belayer_engine.backends.reference import ops
from belayer_engine.model.config import ModelConfig


@dataclass
class SeqBatch:
    """One sequence's part of a forward call: rows [start, end) at positions ending at
    ``ctx_len - 1``; its KV lives in ``block_table`` (block ids into the KV arena)."""

    start: int
    end: int
    ctx_len: int
    block_table: Sequence[int]


class Qwen3Model:
    """Stateless forward over borrowed weights and KV memory."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor], exact: bool,
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.exact = exact
        self.device = torch.device(device)
        self.scale = cfg.head_dim ** -0.5
        self.cos, self.sin = ops.rope_tables(cfg.head_dim, cfg.max_position_embeddings,
                                             cfg.rope_theta, self.device)
        self.set_weights(weights)

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Point at another weight slot (a dict swap: no copy)."""
        self.w = weights
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqBatch],
                kv: torch.Tensor) -> torch.Tensor:
        """Run rows ``ids`` (n,) at ``positions`` (n,); write their K/V into ``kv``; return
        logits (len(seqs), vocab) for each sequence's last row.

        ``exact``: attention row by row per sequence (batch-invariant bits). Otherwise the
        whole ragged batch attends in at most two calls per layer (``ops.RaggedAttention``).
        """
        if self.exact or self.device.type != "cuda":
            return self._forward(ids, positions, seqs, kv)
        with ops.no_cudnn_attention():  # no per-shape plan builds on the eager path
            return self._forward(ids, positions, seqs, kv)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, seqs: Sequence[SeqBatch],
                 kv: torch.Tensor) -> torch.Tensor:
        cfg, w, exact = self.cfg, self.w, self.exact
        n, bs = ids.shape[0], kv.shape[3]
        blk = torch.empty(n, dtype=torch.long)
        for s in seqs:
            pos = positions[s.start : s.end]
            table = torch.as_tensor(s.block_table, dtype=torch.long)
            blk[s.start : s.end] = table[pos // bs]
        blk = blk.to(self.device)
        off = (positions % bs).to(self.device)
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        ragged = None if exact else ops.RaggedAttention(
            [(s.start, s.end, s.ctx_len, s.block_table) for s in seqs], positions, bs, self.device)
        if exact:  # whole tiles of rows from the start: the exact products then copy nothing
            ids, positions = ops.pad_rows(ids), ops.pad_rows(positions)
        cos, sin = self.cos[positions.to(self.device)], self.sin[positions.to(self.device)]

        x = w["model.embed_tokens.weight"][ids.to(self.device)]
        for i in range(cfg.num_hidden_layers):
            q, k, v = ops.layer_qkv(cfg, w, i, x, cos, sin, exact)
            kv[i, 0, blk, off] = k[:n].to(kv.dtype)
            kv[i, 1, blk, off] = v[:n].to(kv.dtype)
            if exact:
                attn = torch.zeros_like(q)  # padding rows attend to nothing
                for s in seqs:
                    nblk = -(-s.ctx_len // bs)
                    table = torch.as_tensor(s.block_table[:nblk], dtype=torch.long,
                                            device=self.device)
                    kc = kv[i, 0, table].reshape(-1, hkv, d)[: s.ctx_len]
                    vc = kv[i, 1, table].reshape(-1, hkv, d)[: s.ctx_len]
                    first = s.ctx_len - (s.end - s.start)
                    attn[s.start : s.end] = ops.attend_rows(q[s.start : s.end], kc, vc, first, self.scale)
            else:
                attn = ragged.attend(q, k, v, kv[i, 0], kv[i, 1], self.scale)
            x = ops.layer_out_mlp(cfg, w, i, x, attn.reshape(x.shape[0], hq * d), exact)
        last = torch.as_tensor([s.end - 1 for s in seqs], dtype=torch.long, device=self.device)
        h = ops.rms_norm(x[last], w["model.norm.weight"], cfg.rms_norm_eps)
        return ops.linear(h, self.lm_head, exact).float()

    @torch.inference_mode()
    def decode_static(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                      ctx_lens: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """One decode row per sequence with shapes fixed by (B, max_blocks): no Python
        control flow depends on the data, so a CUDA graph can capture it.

        ``tables`` (B, M) holds block ids (unused slots point at a scratch block); keys at
        or past ``ctx_lens`` are masked out.
        """
        cfg, w = self.cfg, self.w
        b, bs = ids.shape[0], kv.shape[3]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        blk = tables.gather(1, (positions // bs)[:, None])[:, 0]
        off = positions % bs
        cos, sin = self.cos[positions], self.sin[positions]
        span = tables.shape[1] * bs
        mask = (torch.arange(span, device=ids.device)[None, :] < ctx_lens[:, None])[:, None, None]
        x = w["model.embed_tokens.weight"][ids]
        for i in range(cfg.num_hidden_layers):
            q, k, v = ops.layer_qkv(self.cfg, self.w, i, x, cos, sin, exact=False)
            kv[i, 0, blk, off] = k.to(kv.dtype)
            kv[i, 1, blk, off] = v.to(kv.dtype)
            kc = kv[i, 0][tables].view(b, span, hkv, d).transpose(1, 2)
            vc = kv[i, 1][tables].view(b, span, hkv, d).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q[:, :, None, :], kc, vc, attn_mask=mask,
                                                  scale=self.scale, enable_gqa=hq != hkv)
            x = ops.layer_out_mlp(self.cfg, self.w, i, x, exact=False, attn=attn.reshape(b, hq * d))
        h = ops.rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
        return F.linear(h, self.lm_head).float()

    @torch.inference_mode()
    def prefill_static(self, ids: torch.Tensor, positions: torch.Tensor, blk: torch.Tensor,
                       off: torch.Tensor, last: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """A whole prompt of one sequence, rows (N,) at positions 0..N-1, with shapes fixed
        by N (graphable): K/V go to (``blk``, ``off``), attention is causal over the rows
        themselves; returns logits (1, vocab) of row ``last`` (1,).

        A prompt shorter than N is padded at the end: padding rows come after every real
        row, so the causal mask hides them, and they write their K/V to a scratch block.
        """
        cfg, w = self.cfg, self.w
        n = ids.shape[0]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self.cos[positions], self.sin[positions]
        x = w["model.embed_tokens.weight"][ids]
        for i in range(cfg.num_hidden_layers):
            q, k, v = ops.layer_qkv(self.cfg, self.w, i, x, cos, sin, exact=False)
            kv[i, 0, blk, off] = k.to(kv.dtype)
            kv[i, 1, blk, off] = v.to(kv.dtype)
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], is_causal=True,
                                                  scale=self.scale, enable_gqa=hq != hkv)
            x = ops.layer_out_mlp(self.cfg, self.w, i, x, exact=False, attn=attn[0].transpose(0, 1).reshape(n, hq * d))
        h = ops.rms_norm(x.index_select(0, last), w["model.norm.weight"], cfg.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
