"""Sampling parameters (SGLang's ``sampling_params`` names) and the sampler.

``temperature`` below ``GREEDY_EPS`` (0 included) or ``top_k == 1`` is greedy: the first
maximal logit, which makes greedy output exact and reproducible, and keeps a degenerate
temperature such as 1e-300 from dividing the logits into inf/nan. Otherwise tokens are
drawn with a per-request ``torch.Generator`` seeded from ``seed`` (or ``sampling_seed``,
SGLang's name), 0 <= seed < 2**63. Types are strict (``true`` is not an integer) and
unknown fields are refused, so a feature the worker does not implement (penalties,
constrained decoding) is never silently ignored.

Logprobs (``token_logprobs``) follow SGLang 0.5.23's sampler: greedy is the log-softmax of
the raw logits; otherwise the log-softmax of ``logits / temperature``, before top-k/top-p
(the distribution the draw is made from, before its truncation), as SGLang returns it
unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set.
"""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

GREEDY_EPS = 1e-5  # as SGLang: a smaller temperature is argmax
MAX_SEED = 2**63
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat top_logprobs; more is a 400 naming the field


class SamplingError(ValueError):
    """One request's sampling failed (e.g. non-finite logits): that request alone ends."""


StopString = Annotated[str, StringConstraints(min_length=1, max_length=1024)]


class SamplingParams(BaseModel):
    """SGLang ``sampling_params`` this worker implements; others are refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = -1
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=256)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    sampling_seed: int | None = Field(None, ge=0, lt=MAX_SEED)
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
        return self.temperature < GREEDY_EPS or self.top_k == 1

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
    """One token id from a (vocab,) float32 logits row; ``SamplingError`` if it cannot be drawn."""
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
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        raise SamplingError("the logits cannot be sampled (not finite); the request was ended")
    return int(torch.multinomial(probs, 1, generator=gen))


def token_logprobs(logits: torch.Tensor, params: SamplingParams, token: int,
                   top: int) -> tuple[float, list[tuple[float, int]]]:
    """(logprob of ``token``, the ``top`` most likely (logprob, id)) under the distribution
    SGLang reports: raw logits when greedy, else ``logits / temperature``."""
    x = logits.detach().float()
    if not params.greedy:
        x = x / params.temperature
    lp = torch.log_softmax(x, dim=-1)
    chosen = float(lp[token])
    if not top:
        return chosen, []
    values, ids = torch.topk(lp, min(top, lp.shape[-1]))
    return chosen, list(zip(values.tolist(), ids.tolist(), strict=True))
