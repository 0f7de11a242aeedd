"""The reference worker's SGLang logprob fields: shapes as a real SGLang 0.5.23 server sends
them (checked against one: ``[logprob, id, null]`` entries, cumulative in a stream, empty
``input_token_logprobs`` with the default ``logprob_start_len``), and SGLang's semantics:
greedy reports the log-softmax of the raw logits, sampling that of ``logits / temperature``
before top-k/top-p truncation.
"""

from __future__ import annotations

import math

import pytest

from belayer_engine.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.timeout(120)

PROMPT = list(b"The rope holds")


def _gen(worker, n: int = 8, top: int = 5, **params) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0.0, **params},
            "return_logprob": True, "top_logprobs_num": top}
    status, out = worker.post("/generate", body)
    assert status == 200, out
    return out


def test_greedy_logprobs_have_sglangs_shape_and_are_the_argmax(shared_worker):
    out = _gen(shared_worker)
    meta, ids = out["meta_info"], out["output_ids"]
    entries, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(entries) == len(tops) == len(ids) == meta["output_token_logprobs_length"] == 8
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    for (lp, tok, text), top, want in zip(entries, tops, ids, strict=True):
        assert tok == want and text is None and lp <= 0.0
        assert len(top) == 5 and all(len(e) == 3 and e[2] is None for e in top)
        values = [e[0] for e in top]
        assert values == sorted(values, reverse=True)
        assert top[0][1] == tok and top[0][0] == lp, "greedy: the sampled token is the most likely one"
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
    plain = shared_worker.generate(PROMPT, 8)
    assert plain["output_ids"] == ids, "asking for logprobs does not change the output"
    assert not {k for k in plain["meta_info"] if "logprob" in k}, "no logprob fields unless asked"


def test_sampling_logprobs_are_after_temperature_and_before_top_p(shared_worker):
    """Position 0 sees the same logits in every request: greedy's top logprobs are the raw
    log-softmax; at temperature T the gaps between them scale by 1/T; top-p does not change them."""
    raw = [e[0] for e in _gen(shared_worker, n=1)["meta_info"]["output_top_logprobs"][0]]
    same = [e[0] for e in _gen(shared_worker, n=1, temperature=1.0, seed=1)["meta_info"]["output_top_logprobs"][0]]
    assert same == pytest.approx(raw, abs=1e-5), "temperature 1 reports the raw distribution"
    hot = _gen(shared_worker, n=1, temperature=0.5, seed=1)["meta_info"]["output_top_logprobs"][0]
    cut = _gen(shared_worker, n=1, temperature=0.5, top_p=0.1, seed=1)["meta_info"]["output_top_logprobs"][0]
    assert [e[0] for e in cut] == pytest.approx([e[0] for e in hot], abs=1e-6)
    for i in range(1, 5):
        assert hot[0][0] - hot[i][0] == pytest.approx((raw[0] - raw[i]) / 0.5, abs=1e-4)
    sampled = _gen(shared_worker, n=6, temperature=0.9, seed=3)["meta_info"]
    for (lp, tok, _), top in zip(sampled["output_token_logprobs"], sampled["output_top_logprobs"], strict=True):
        listed = {t: v for v, t, _ in top}
        assert lp <= top[0][0] + 1e-6 and (tok not in listed or listed[tok] == pytest.approx(lp, abs=1e-6))


def test_streamed_logprobs_are_cumulative_like_output_ids(shared_worker):
    events = shared_worker.stream({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
                                   "return_logprob": True, "return_text_in_logprobs": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for ev in chunks:
        entries = ev["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in entries] == ev["output_ids"]
        assert "output_top_logprobs" not in ev["meta_info"], "top_logprobs_num 0: no top lists"
    final = chunks[-1]["meta_info"]["output_token_logprobs"]
    whole = _gen(shared_worker, n=6, top=0)["meta_info"]["output_token_logprobs"]
    assert [e[:2] for e in final] == [e[:2] for e in whole]
    tok = load_tokenizer(None)  # the embedded model's
    assert [e[2] for e in final] == [tok.decode([t], skip_special_tokens=False) for _, t, _ in final]


@pytest.mark.parametrize(("extra", "field"), [
    ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
    ({"return_logprob": "yes"}, "return_logprob"),
])
def test_bad_logprob_fields_are_a_400_naming_the_field(shared_worker, extra, field):
    status, out = shared_worker.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, **extra})
    assert status == 400 and field in out["error"]["message"], out
