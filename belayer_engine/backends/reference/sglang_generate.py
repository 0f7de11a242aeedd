"""SGLang's ``/generate`` as the reference worker speaks it: the body it accepts and the
chunk it answers per scheduler event (``meta_info`` and the logprob fields).

Routes and fields are documented in docs/engine.md; the contract with the router is
docs/contracts.md.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from belayer_core.errors import UsageError
from belayer_engine.backends.reference.request import Request
from belayer_engine.backends.reference.sampling import MAX_TOP_LOGPROBS, SamplingParams
from belayer_engine.common.json_body import parse_json_object
from belayer_engine.model.tokenizer import Tokenizer


class GenerateRequest(BaseModel):
    """SGLang ``/generate`` body (single request). Unknown fields (SGLang features this
    worker does not implement: input-token logprobs, LoRA, images, ...) are refused by name.

    ``return_logprob`` / ``top_logprobs_num`` add SGLang's ``meta_info``
    ``output_token_logprobs`` ([logprob, id, text|None] per output token) and
    ``output_top_logprobs`` (a list of such entries per output token), cumulative in a
    stream like ``output_ids``. Input-token logprobs are not computed: ``logprob_start_len``
    may only be -1 (SGLang's default) and ``input_token_logprobs`` (``input_top_logprobs``)
    are empty, as SGLang's own are with that default.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: Literal[-1] = -1
    return_text_in_logprobs: bool = False


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def parse_generate(raw: bytes, tokenizer: Tokenizer, vocab_size: int) -> GenerateRequest:
    """The request in ``raw``, its prompt as ids in [0, vocab_size); a ``UsageError`` naming
    the problem otherwise."""
    body = parse_json_object(raw, "body must be a JSON object (batched requests are not supported)")
    try:
        g = GenerateRequest.model_validate(body)
    except ValidationError as exc:
        raise UsageError(_validation_message(exc)) from exc
    if (g.text is None) == (g.input_ids is None):
        raise UsageError("give exactly one of 'text' or 'input_ids'")
    ids = g.input_ids if g.input_ids is not None else tokenizer.encode(g.text)
    if not ids:
        raise UsageError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"input_ids out of range [0, {vocab_size}): {bad[:5]}")
    g.input_ids = ids
    return g


def generate_chunk(req: Request, ev: dict, tokenizer: Tokenizer) -> dict:
    """SGLang's answer (or stream chunk) for one scheduler event of ``req``."""
    p = req.params
    text = tokenizer.decode(ev["output_ids"], skip_special_tokens=p.skip_special_tokens)
    fr = ev["finish_reason"]
    if fr and isinstance(fr.get("matched"), str) and not p.no_stop_trim:
        cut = text.find(fr["matched"])
        text = text[:cut] if cut >= 0 else text
    return {"text": text, "output_ids": ev["output_ids"], "meta_info": {
        "id": req.rid, "finish_reason": fr, "prompt_tokens": len(req.prompt),
        "completion_tokens": len(ev["output_ids"]), "cached_tokens": 0,
        "weight_version": ev["weight_version"],
        "weight_version_start": ev["weight_version_start"],
        "e2e_latency": time.time() - req.created, **_logprobs(req, ev, tokenizer)}}


def _logprobs(req: Request, ev: dict, tokenizer: Tokenizer) -> dict:
    """SGLang's logprob fields of one event (nothing when they were not asked for)."""
    if "logprobs" not in ev:
        return {}
    n = len(ev["logprobs"])
    texts = req.logprob_texts
    if texts is not None:  # return_text_in_logprobs: decode each token once
        decode = tokenizer.decode
        texts.update({i: decode([i], skip_special_tokens=False) for i in ev["output_ids"][:n] if i not in texts})
        for top in ev["top_logprobs"] or ():
            texts.update({i: decode([i], skip_special_tokens=False) for _, i in top if i not in texts})
    name = (lambda i: texts[i]) if texts is not None else (lambda i: None)
    out = {"input_token_logprobs": [],
           "output_token_logprobs": [[lp, i, name(i)] for lp, i in zip(ev["logprobs"], ev["output_ids"][:n], strict=True)],
           "output_token_logprobs_length": n}
    if ev["top_logprobs"] is not None:
        out["input_top_logprobs"] = []
        out["output_top_logprobs"] = [[[lp, i, name(i)] for lp, i in top] for top in ev["top_logprobs"]]
    return out
