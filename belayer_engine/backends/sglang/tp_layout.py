"""One tensor-parallel rank's shard of a Qwen3 in SGLang's layout (issue 37, part 1).

A TP SGLang server holds on rank ``r`` of ``n``: its ``n``-th of the attention heads in a
fused ``qkv_proj`` ([q heads of r; kv heads of r; kv heads of r], a kv head replicated on
``n / kv_heads`` ranks when there are fewer kv heads than ranks), its share of
``gate_up_proj`` rows ([gate rows of r; up rows of r]), the matching input columns of
``o_proj`` and ``down_proj``, its contiguous slice of the vocabulary (padded to 64, as
SGLang's ``VocabParallelEmbedding`` on a GPU), and full copies of norms and the rotary
cache. ``layout.plan`` lays a rank out (``SGLangWeights(cfg, device, rank, size)``); this
module checks that a model splits and counts a rank's bytes. The arena serves every rank's
shard over SGLang's weight-cache socket (``weight_cache.py``).
"""

from __future__ import annotations

import torch

from belayer_core.errors import UsageError
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import torch_dtype

from .layout import SGLangWeights, padded_vocab


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


def shard(cfg: ModelConfig, hf: dict[str, torch.Tensor], rank: int, size: int,
          device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """SGLang-named tensors of rank ``rank`` of ``size`` (views of one new flat buffer)."""
    check_tp(cfg, size)
    if not 0 <= rank < size:
        raise UsageError(f"tp_rank {rank} outside 0..{size - 1}")
    weights = SGLangWeights(cfg, device, rank, size)
    weights.write(hf)
    return weights.tensors


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
