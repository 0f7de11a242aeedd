"""Sampling parameters validation and seeded sampling."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from belayer_engine.backends.reference.sampling import SamplingParams, sample


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=11)
    a = [sample(logits, p, g) for g in [p.generator()] for _ in range(20)]
    b = [sample(logits, p, g) for g in [p.generator()] for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_greedy_and_top_k_one():
    logits = torch.tensor([0.1, 3.0, 3.0, -1.0])
    assert sample(logits, SamplingParams(temperature=0.0), None) == 1  # first maximum
    p = SamplingParams(top_k=1)
    assert p.greedy and sample(logits, p, p.generator()) == 1


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([10.0, 9.0, -10.0, -10.0])
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=0)
    g = p.generator()
    assert {sample(logits, p, g) for _ in range(50)} == {0}


@pytest.mark.parametrize("bad", [{"max_new_tokens": -1}, {"temperature": -0.5},
                                 {"top_p": 0.0}, {"top_k": 0}, {"stop_token_ids": ["x"]}])
def test_invalid_params(bad):
    with pytest.raises(ValidationError):
        SamplingParams(**bad)


def test_stop_accepts_string_and_ignores_unknown_fields():
    p = SamplingParams(stop="\n", frequency_penalty=0.0)
    assert p.stop == ["\n"]
