"""Sampling parameters validation and seeded sampling."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from belayer_engine.backends.reference.sampling import SamplingError, SamplingParams, sample


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


@pytest.mark.parametrize("bad", [
    {"max_new_tokens": -1}, {"temperature": -0.5}, {"top_p": 0.0}, {"top_k": 0},
    {"stop_token_ids": ["x"]}, {"max_new_tokens": True}, {"temperature": "1"},
    {"temperature": float("inf")}, {"seed": 2**64}, {"seed": 2**63}, {"seed": -1},
    {"sampling_seed": 2**64}, {"stop": 5}, {"stop": [""]}, {"frequency_penalty": 0.5},
    {"json_schema": "{}"}, {"ignore_eos": 1},
])
def test_invalid_params(bad):
    with pytest.raises(ValidationError):
        SamplingParams.model_validate(bad)


def test_stop_accepts_a_string_and_seeds_span_63_bits():
    assert SamplingParams.model_validate({"stop": "\n"}).stop == ["\n"]
    p = SamplingParams.model_validate({"temperature": 1, "seed": 2**63 - 1})
    assert p.generator().initial_seed() == 2**63 - 1


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_degenerate_temperature_is_greedy(temperature):
    """A temperature that would divide logits into inf/nan is argmax, as temperature 0."""
    logits = torch.randn(512, generator=torch.Generator().manual_seed(3)) * 30
    p = SamplingParams(temperature=temperature)
    assert p.greedy and p.generator() is None
    assert sample(logits, p, None) == int(torch.argmax(logits))


def test_non_finite_logits_raise_a_sampling_error():
    p = SamplingParams(temperature=0.7, seed=1)
    with pytest.raises(SamplingError, match="not finite"):
        sample(torch.tensor([0.0, float("nan"), 1.0]), p, p.generator())
