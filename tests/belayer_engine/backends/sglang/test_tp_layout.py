"""A tensor-parallel rank's shard of SGLang's layout (issue 37, part 1): the shards of all
ranks put back together are the single-GPU layout, kv heads are replicated as SGLang does
when there are fewer than ranks, and a rank's byte count is what its arena would hold."""

from __future__ import annotations

import pytest
import torch

from belayer_core.errors import UsageError
from belayer_engine.backends.sglang.layout import SGLangWeights
from belayer_engine.backends.sglang.model_dir import embedded_config
from belayer_engine.backends.sglang.tp_layout import shard, shard_nbytes
from belayer_engine.model.weights import init_weights


def test_one_rank_is_the_single_gpu_layout():
    cfg = embedded_config(vocab_size=500)
    hf = init_weights(cfg, seed=1)
    one = SGLangWeights(cfg)
    one.write(hf)
    got = shard(cfg, hf, 0, 1)
    assert set(got) == set(one.tensors)
    for name, t in one.tensors.items():
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("size", [2, 4])
def test_the_ranks_shards_put_together_are_the_whole_model(size):
    cfg = embedded_config(vocab_size=500, num_key_value_heads=4)
    hf = init_weights(cfg, seed=2)
    whole = SGLangWeights(cfg)
    whole.write(hf)
    ranks = [shard(cfg, hf, r, size) for r in range(size)]
    w = whole.tensors
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary split by rows
        assert torch.equal(torch.cat([s[name] for s in ranks]), w[name])
    p = "model.layers.1."
    for name in (p + "self_attn.o_proj.weight", p + "mlp.down_proj.weight"):  # input columns split
        assert torch.equal(torch.cat([s[name] for s in ranks], dim=1), w[name])
    q, kv, i = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    qkv = [s[p + "self_attn.qkv_proj.weight"] for s in ranks]
    assert torch.equal(torch.cat([t[: q // size] for t in qkv]), w[p + "self_attn.qkv_proj.weight"][:q])
    assert torch.equal(torch.cat([t[q // size: q // size + kv // size] for t in qkv]),
                       w[p + "self_attn.qkv_proj.weight"][q:q + kv])
    gate_up = [s[p + "mlp.gate_up_proj.weight"] for s in ranks]
    assert torch.equal(torch.cat([t[i // size:] for t in gate_up]), hf[p + "mlp.up_proj.weight"])
    assert torch.equal(ranks[size - 1]["model.norm.weight"], w["model.norm.weight"])  # replicated
    for r, s in enumerate(ranks):  # the bytes a rank's arena holds (rotary cache apart)
        held = sum(t.numel() * t.element_size() for n, t in s.items() if not n.endswith("cos_sin_cache"))
        assert shard_nbytes(cfg, size) == held, r


def test_fewer_kv_heads_than_ranks_are_replicated_like_sglang():
    cfg = embedded_config(num_key_value_heads=2)
    hf = init_weights(cfg, seed=3)
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    d, q = cfg.head_dim, cfg.num_attention_heads * cfg.head_dim // 4
    heads = [shard(cfg, hf, r, 4)["model.layers.0.self_attn.qkv_proj.weight"][q:q + d] for r in range(4)]
    assert torch.equal(heads[0], k[:d]) and torch.equal(heads[1], k[:d])  # ranks 0, 1: kv head 0
    assert torch.equal(heads[2], k[d:]) and torch.equal(heads[3], k[d:])  # ranks 2, 3: kv head 1


def test_splits_sglang_could_not_make_are_refused():
    cfg = embedded_config()
    hf = init_weights(cfg, seed=4)
    with pytest.raises(UsageError, match="attention heads"):
        shard(cfg, hf, 0, 3)
    with pytest.raises(UsageError, match="tp_rank"):
        shard(cfg, hf, 2, 2)
    with pytest.raises(UsageError, match="positive"):
        shard(cfg, hf, 0, 0)
