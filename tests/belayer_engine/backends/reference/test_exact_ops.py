"""The exact CPU path's own assumptions, checked on the machine that runs the tests.

Batch invariance of the worker (tests/belayer_engine/test_model.py checks it end to end)
rests on two properties of the primitives: a row's product in a fixed tile does not depend
on its place in the tile nor on its neighbours, and a row's attention depends only on its
own keys (prefill and decode of one position give the same bits).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from belayer_engine.backends.reference import ops
from belayer_engine.model.config import ModelConfig

torch.set_num_threads(1)  # the worker's setting: exactness holds for a fixed thread count

CFG = ModelConfig()
SHAPES = sorted({(CFG.num_attention_heads * CFG.head_dim, CFG.hidden_size),
                 (CFG.num_key_value_heads * CFG.head_dim, CFG.hidden_size),
                 (CFG.hidden_size, CFG.num_attention_heads * CFG.head_dim),
                 (CFG.intermediate_size, CFG.hidden_size), (CFG.hidden_size, CFG.intermediate_size),
                 (CFG.vocab_size, CFG.hidden_size)})


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_a_rows_product_is_the_same_at_every_place_of_a_tile_and_with_any_neighbours(out_features, in_features):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    rows = torch.randn(3, in_features, generator=gen)
    alone = [ops.linear(r[None], weight, exact=True)[0] for r in rows]
    for place in range(ops.TILE_ROWS):
        for n in (place + 1, ops.TILE_ROWS, ops.TILE_ROWS + place + 1):
            batch = torch.randn(n, in_features, generator=gen) * 10
            for r, want in zip(rows, alone, strict=True):
                batch[place] = r
                assert torch.equal(ops.linear(batch, weight, exact=True)[place], want), (place, n)
    # and the tiled product is still the product
    torch.testing.assert_close(ops.linear(rows, weight, exact=True), F.linear(rows, weight))


def test_attention_of_a_row_depends_only_on_its_own_keys():
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, ctx = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim, 37
    q = torch.randn(ctx, hq, d, generator=gen)
    k, v = torch.randn(ctx, hkv, d, generator=gen), torch.randn(ctx, hkv, d, generator=gen)
    prefill = ops.attend_rows(q, k, v, 0, d ** -0.5)  # every row at once, as a prompt
    for p in (0, 1, 17, ctx - 1):  # one decode row at position p, over a cache with more keys after it
        longer = torch.cat([k[: p + 1], torch.randn(5, hkv, d, generator=gen)])
        decode = ops.attend_rows(q[p : p + 1], longer, torch.cat([v[: p + 1], longer[p + 1:]]), p, d ** -0.5)
        assert torch.equal(decode[0], prefill[p]), p
    # grouped heads: query head h uses key/value head h // (hq // hkv), as with repeated keys
    group = hq // hkv
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True, scale=d ** -0.5).transpose(0, 1)
    torch.testing.assert_close(prefill, want, rtol=1e-5, atol=1e-5)
