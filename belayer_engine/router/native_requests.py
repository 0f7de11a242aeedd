"""SGLang's native ``/generate`` body, validated strictly and expanded into generations.

The fields and their meaning are SGLang 0.5.23's (``GenerateReqInput``): ``text`` or
``input_ids``, one prompt or a batch, ``sampling_params`` (one or one per prompt) with
``n`` samples each, ``rid`` (a string, a prefix for a batch, or one per prompt), logprob
options, ``stream``. Types are strict and every field SGLang knows but this engine does not
implement (images, LoRA, input-token logprobs, penalties, grammars, ...) is refused by
name unless it carries SGLang's neutral value; an unknown field is refused too. SGLang
ignores unknown fields; silently dropping one would change what a trainer gets.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)

from belayer_core.errors import UsageError

from .requests import MAX_N, MAX_SEED, MAX_STOP, MAX_TOP_LOGPROBS, TokenId

MAX_BATCH = 256  # prompts in one batched body (each a generation of its own)

# Known SGLang request fields this engine does not implement, and their neutral values.
UNSUPPORTED_BODY: dict[str, tuple] = {
    "input_embeds": (None,), "image_data": (None, []), "video_data": (None, []),
    "audio_data": (None, []), "mm_hashes": (None,), "token_ids_logprob": (None,),
    "return_hidden_states": (None, False), "return_routed_experts": (None, False),
    "return_indexer_topk": (None, False), "return_sampling_mask": (None, False),
    "lora_path": (None,), "lora_id": (None,), "session_params": (None,), "session_id": (None,),
    "custom_logit_processor": (None,), "bootstrap_host": (None,), "bootstrap_port": (None,),
    "bootstrap_room": (None,), "bootstrap_pair_key": (None,), "data_parallel_rank": (None,),
    "routed_dp_rank": (None,), "modalities": (None,), "return_prompt_token_ids": (None, False),
    "return_flat_raw_top_logprobs": (None, False), "return_flat_raw_output_top_logprobs": (None, False),
}
# Fields with no effect on what is generated, accepted as SGLang accepts them.
IGNORED_BODY = ("log_metrics", "priority", "routing_key", "extra_key", "custom_labels", "cache_salt")
UNSUPPORTED_SAMPLING: dict[str, tuple] = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_new_tokens": (None, 0), "json_schema": (None,),
    "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "stop_regex": (None, []),
    "logit_bias": (None, {}), "custom_params": (None,), "beam_width": (None, 1),
    # False is slime's: SGLang's fast tokenizers put no spaces between special tokens either way
    "spaces_between_special_tokens": (None, True, False), "stream_interval": (None,), "watermark": (None,),
}

StopString = Annotated[str, StringConstraints(min_length=1, max_length=1024)]


class NativeSampling(BaseModel):
    """One ``sampling_params`` object; ``None`` means SGLang's default, as in SGLang."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=256)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    sampling_seed: int | None = Field(None, ge=0, lt=MAX_SEED)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    def worker_params(self) -> dict:
        """What the worker gets (without ``max_new_tokens``: the router owns the budget)."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                               "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
                               "no_stop_trim": self.no_stop_trim}
        if self.min_p:
            out["min_p"] = self.min_p  # a backend that has no min_p refuses it by name
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        return out


@dataclass
class NativeItem:
    """One generation of a native request (a prompt of the batch, one of its ``n`` samples)."""

    prompt_ids: list[int]
    sampling: NativeSampling
    rid: str
    return_logprob: bool
    top_logprobs_num: int
    text_in_logprobs: bool


@dataclass
class NativeRequest:
    items: list[NativeItem]
    batched: bool  # the response is a list (a batch, or n > 1), as SGLang answers
    stream: bool


def _drop_neutral(body: dict, table: dict[str, tuple], where: str) -> dict:
    out = {}
    for key, value in body.items():
        if key in table:
            if not any(value == ok and type(value) is type(ok) for ok in table[key]):
                raise UsageError(f"{where}{key}: not supported by this engine (only {table[key]!r} accepted)")
            continue
        out[key] = value
    return out


def _per_item(value, count: int, name: str, default):
    """SGLang's broadcasting: one value for every prompt, or a list of one per prompt."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise UsageError(f"{name}: a list of {len(value)} for {count} prompt(s)")
        return [default if v is None else v for v in value]
    return [value] * count


def _check(value, kind, name: str, **bounds):
    if type(value) is not kind and not (kind is int and type(value) is int):
        raise UsageError(f"{name}: expected {kind.__name__}, got {type(value).__name__}")
    lo, hi = bounds.get("ge"), bounds.get("le")
    if lo is not None and value < lo or hi is not None and value > hi:
        raise UsageError(f"{name}: {value} is out of range [{lo}, {hi}]")
    return value


def _prompts(body: dict, encode) -> tuple[list[list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise UsageError("give exactly one of 'text' or 'input_ids'")
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise UsageError("text: a string or a list of strings")
        prompts = [encode(t) for t in texts]
    else:
        single = isinstance(ids, list) and all(type(i) is int for i in ids) and bool(ids)
        prompts = [ids] if single else ids
        if not isinstance(prompts, list) or not all(
                isinstance(p, list) and all(type(i) is int and 0 <= i < 2**31 for i in p) for p in prompts):
            raise UsageError("input_ids: a list of token ids (ints >= 0) or a list of such lists")
    if not prompts:
        raise UsageError("input_ids/text: the batch is empty")
    if len(prompts) > MAX_BATCH:
        raise UsageError(f"input_ids/text: {len(prompts)} prompts in one body (at most {MAX_BATCH})")
    for i, p in enumerate(prompts):
        if not p:
            raise UsageError(f"prompt {i} is empty")
    return [list(p) for p in prompts], single


def _sampling(raw, where: str) -> NativeSampling:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: a JSON object")
    raw = {k: v for k, v in _drop_neutral(raw, UNSUPPORTED_SAMPLING, where + ".").items() if v is not None}
    try:
        return NativeSampling.model_validate(raw)
    except ValidationError as exc:
        raise UsageError("; ".join(f"{where}.{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}"
                                   for e in exc.errors())) from exc


KNOWN = {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob", "top_logprobs_num",
         "logprob_start_len", "return_text_in_logprobs"}


def parse_native(body: Any, encode) -> NativeRequest:
    """A validated ``/generate`` body; ``encode`` tokenizes ``text`` prompts."""
    if not isinstance(body, dict):
        raise UsageError("body must be a JSON object")
    body = {k: v for k, v in _drop_neutral(body, UNSUPPORTED_BODY, "").items() if k not in IGNORED_BODY}
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise UsageError(f"unknown field(s) {unknown}: not part of SGLang's /generate that this engine serves")
    prompts, single = _prompts(body, encode)
    count = len(prompts)
    stream = body.get("stream")
    stream = False if stream is None else _check(stream, bool, "stream")
    text_in = body.get("return_text_in_logprobs")
    text_in = False if text_in is None else _check(text_in, bool, "return_text_in_logprobs")
    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list) and single:
        raise UsageError("sampling_params: a list needs a batch of prompts")
    samplings = [_sampling(sp, "sampling_params" + (f"[{i}]" if isinstance(raw_sp, list) else ""))
                 for i, sp in enumerate(_per_item(raw_sp, count, "sampling_params", None))]
    n = samplings[0].n
    if any(s.n != n for s in samplings):
        raise UsageError("sampling_params.n: the same n for every prompt (as SGLang requires)")
    lps = [_check(v, bool, "return_logprob") for v in _per_item(body.get("return_logprob"), count, "return_logprob", False)]
    tops = [_check(v, int, "top_logprobs_num", ge=0, le=MAX_TOP_LOGPROBS)
            for v in _per_item(body.get("top_logprobs_num"), count, "top_logprobs_num", 0)]
    for v in _per_item(body.get("logprob_start_len"), count, "logprob_start_len", -1):
        if _check(v, int, "logprob_start_len") != -1:
            raise UsageError("logprob_start_len: only -1 (no input-token logprobs) is supported by this engine")
    if n > 1 and any(isinstance(body.get(k), list) for k in ("return_logprob", "top_logprobs_num")):
        raise UsageError("return_logprob/top_logprobs_num: a list cannot be used with n > 1 (as in SGLang)")
    rids = _rids(body.get("rid"), count, single and n == 1)
    items = []
    for i in range(count):
        for _ in range(n):
            rid = rids[i] if n == 1 else uuid.uuid4().hex  # SGLang gives every sample a new id
            items.append(NativeItem(prompts[i], samplings[i], rid, lps[i], tops[i] if lps[i] else 0, text_in))
    return NativeRequest(items=items, batched=not (single and n == 1), stream=stream)


def _rids(rid, count: int, single: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str) and rid:
        return [rid] if single else [f"{rid}_{i}" for i in range(count)]
    if isinstance(rid, list) and not single and all(isinstance(r, str) and r for r in rid):
        if len(rid) != count:
            raise UsageError(f"rid: {len(rid)} ids for {count} prompts")
        if len(set(rid)) != len(rid):
            raise UsageError("rid: duplicate request ids in one body")
        return list(rid)
    raise UsageError("rid: a non-empty string (a prefix for a batch) or a list of one per prompt")
