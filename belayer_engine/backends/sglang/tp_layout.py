"""One tensor-parallel rank's shard of a Qwen3 in SGLang's layout (issue 37, part 1).

A TP SGLang server holds on rank ``r`` of ``n``: its ``n``-th of the attention heads in a
fused ``qkv_proj`` ([q heads of r; kv heads of r; kv heads of r], a kv head replicated on
``n / kv_heads`` ranks when there are fewer kv heads than ranks), its share of
``gate_up_proj`` rows ([gate rows of r; up rows of r]), the matching input columns of
``o_proj`` and ``down_proj``, its contiguous slice of the vocabulary (padded to 64, as
SGLang's ``VocabParallelEmbedding`` on a GPU), and full copies of norms and the rotary
cache. This module computes those shards from HF-named weights, so a per-GPU arena can own
exactly its rank's bytes; ``tp_size == 1`` gives ``layout.SGLangWeights``' tensors.
Not yet served over the weight-cache socket (that needs two GPUs to test end to end).
"""

from __future__ import annotations

import torch

from belayer_core.errors import UsageError
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import torch_dtype

from .layout import padded_vocab, rotary_cache


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    """UsageError when SGLang could not split this model over ``tp_size`` ranks."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise UsageError(f"tp_size must be a positive int, got {tp_size!r}")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp_size:
        raise UsageError(f"{heads} attention heads do not split over tp_size {tp_size}")
    if (kv % tp_size) if kv >= tp_size else (tp_size % kv):
        raise UsageError(f"{kv} kv heads do not split over (or replicate onto) tp_size {tp_size}")
    if cfg.intermediate_size % tp_size:
        raise UsageError(f"intermediate size {cfg.intermediate_size} does not split over tp_size {tp_size}")
    if padded_vocab(cfg) % tp_size:
        raise UsageError(f"padded vocabulary {padded_vocab(cfg)} does not split over tp_size {tp_size}")


def _rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    per = t.shape[0] // size
    return t[rank * per:(rank + 1) * per]


def _kv_heads(t: torch.Tensor, cfg: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """This rank's kv heads (rows of k_proj or v_proj); replicated when kv heads < ranks."""
    kv, d = cfg.num_key_value_heads, cfg.head_dim
    if kv >= size:
        return _rows(t, rank, size)
    head = rank // (size // kv)
    return t[head * d:(head + 1) * d]


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def shard(cfg: ModelConfig, hf: dict[str, torch.Tensor], rank: int, size: int,
          device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """SGLang-named tensors of rank ``rank`` of ``size`` (new tensors, contiguous)."""
    check_tp(cfg, size)
    if not 0 <= rank < size:
        raise UsageError(f"tp_rank {rank} outside 0..{size - 1}")
    vocab = padded_vocab(cfg)
    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = _rows(_padded(hf["model.embed_tokens.weight"], vocab), rank, size)
    rotary = rotary_cache(cfg).to(torch.float32 if torch.device(device).type == "cuda" else hf["model.norm.weight"].dtype)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        out[a + "qkv_proj.weight"] = torch.cat([_rows(hf[a + "q_proj.weight"], rank, size),
                                                _kv_heads(hf[a + "k_proj.weight"], cfg, rank, size),
                                                _kv_heads(hf[a + "v_proj.weight"], cfg, rank, size)])
        out[a + "o_proj.weight"] = _rows(hf[a + "o_proj.weight"].t(), rank, size).t()
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = hf[a + "q_norm.weight"]
            out[a + "k_norm.weight"] = hf[a + "k_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        m = p + "mlp."
        out[m + "gate_up_proj.weight"] = torch.cat([_rows(hf[m + "gate_proj.weight"], rank, size),
                                                    _rows(hf[m + "up_proj.weight"], rank, size)])
        out[m + "down_proj.weight"] = _rows(hf[m + "down_proj.weight"].t(), rank, size).t()
        out[a + "rotary_emb.cos_sin_cache"] = rotary
    out["model.norm.weight"] = hf["model.norm.weight"]
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    else:
        out["lm_head.weight"] = _rows(_padded(hf["lm_head.weight"], vocab), rank, size)
    return {k: v.contiguous().to(device) for k, v in out.items()}


def shard_nbytes(cfg: ModelConfig, size: int) -> int:
    """Bytes of one rank's weights (the rotary cache counted once): what its arena holds."""
    esize = torch.empty(0, dtype=torch_dtype(cfg.dtype)).element_size()
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    kv_rows = max(cfg.num_key_value_heads // size, 1) * d
    per_layer = ((cfg.num_attention_heads // size) * d + 2 * kv_rows) * h + h * (cfg.num_attention_heads // size) * d
    per_layer += 2 * (i // size) * h + h * (i // size) + 2 * h + (2 * d if cfg.qk_norm else 0)
    vocab = padded_vocab(cfg) // size * h
    total = cfg.num_hidden_layers * per_layer + h + vocab * (1 if cfg.tie_word_embeddings else 2)
    return total * esize
