"""Sampling parameters (SGLang's ``sampling_params`` names) and the sampler.

``temperature == 0`` (or ``top_k == 1``) is greedy: the first maximal logit, which makes
greedy output exact and reproducible. Otherwise tokens are drawn with a per-request
``torch.Generator`` seeded from ``seed`` (or ``sampling_seed``, SGLang's name).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """Unknown SGLang fields are accepted and ignored; known ones are validated."""

    model_config = ConfigDict(extra="ignore")

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    sampling_seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_list(cls, v):
        return [] if v is None else v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else self.sampling_seed
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        return gen


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from a (vocab,) float32 logits row."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.detach().float().cpu() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[0]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < params.top_p
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
