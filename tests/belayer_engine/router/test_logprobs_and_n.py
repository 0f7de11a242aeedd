"""Logprobs, token ids and ``n`` through the router, with the openai SDK as the client.

The values are the worker's own (SGLang's ``output_token_logprobs``), one per response
token: ``len(logprobs) == len(token_ids) == completion_tokens``, streamed or not.
"""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from belayer_engine.engine import RecoverableEngine
from belayer_engine.router.codec import load_codec

pytestmark = pytest.mark.timeout(240)

MESSAGES = [{"role": "user", "content": "Say something about ropes."}]
CODEC = load_codec(None)
GREEDY = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def engine():
    with RecoverableEngine.launch(workers=1, shadow=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0)


def _direct(engine, ids: list[int], n: int, top: int) -> dict:
    """The worker's own answer to the same prompt ids (SGLang's /generate)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": top}
    url = engine.status()["slots"]["w0"]["worker_url"]

    async def go():
        async with aiohttp.ClientSession(headers=engine.worker_headers()) as s, s.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()
    return asyncio.run(go())


def test_chat_logprobs_are_the_workers_with_token_strings_and_ids(engine, client):
    resp = client.chat.completions.create(model="m", messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    choice = resp.choices[0]
    ids, content = choice.model_extra["token_ids"], choice.logprobs.content
    assert len(content) == len(ids) == resp.usage.completion_tokens == 12
    prompt = CODEC.render_chat(MESSAGES)
    assert resp.model_extra["prompt_token_ids"] == prompt
    direct = _direct(engine, prompt, 12, 3)
    assert direct["output_ids"] == ids
    assert [c.logprob for c in content] == [e[0] for e in direct["meta_info"]["output_token_logprobs"]]
    for c, tok, top in zip(content, ids, direct["meta_info"]["output_top_logprobs"], strict=True):
        assert c.token == CODEC.decode([tok])
        assert [t.logprob for t in c.top_logprobs] == [e[0] for e in top]
        assert [t.token for t in c.top_logprobs] == [CODEC.decode([e[1]]) for e in top]
        assert c.bytes is None or bytes(c.bytes).decode() == c.token
    plain = client.chat.completions.create(model="m", messages=MESSAGES, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].model_extra["token_ids"] == ids


def test_streamed_chat_logprobs_equal_the_whole_response(client):
    whole = client.chat.completions.create(model="m", messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    ids, lps, tops, usage, prompts = [], [], [], None, []
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, logprobs=True, top_logprobs=2, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY):
        usage = chunk.usage or usage
        prompts.append(chunk.model_extra.get("prompt_token_ids"))
        for c in chunk.choices:
            ids += c.model_extra.get("token_ids") or []
            if c.logprobs:
                lps += [e.logprob for e in c.logprobs.content]
                tops += [[t.logprob for t in e.top_logprobs] for e in c.logprobs.content]
    assert ids == whole.choices[0].model_extra["token_ids"]
    assert lps == [e.logprob for e in whole.choices[0].logprobs.content]
    assert tops == [[t.logprob for t in e.top_logprobs] for e in whole.choices[0].logprobs.content]
    assert len(lps) == usage.completion_tokens == 12
    assert prompts[0] == CODEC.render_chat(MESSAGES) and not any(prompts[1:]), "the prompt's ids come once, first"


def test_completions_legacy_logprobs_streamed_and_not(client):
    whole = client.completions.create(model="m", prompt="The rope", logprobs=2, **GREEDY)
    choice = whole.choices[0]
    ids, lp = choice.model_extra["token_ids"], choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) == 12
    assert lp.tokens == [CODEC.decode([i]) for i in ids]
    assert all(len(d) <= 2 and max(d.values()) >= v - 1e-6 for d, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset == [len(CODEC.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert whole.model_extra["prompt_token_ids"] == list(b"The rope")
    tokens, values, offsets = [], [], []
    for chunk in client.completions.create(model="m", prompt="The rope", logprobs=2, stream=True, **GREEDY):
        for c in chunk.choices:
            if c.logprobs:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert (tokens, values, offsets) == (lp.tokens, lp.token_logprobs, lp.text_offset)


def test_n_choices_are_independent_seeded_and_reproducible(client):
    args = {"model": "m", "prompt": "The rope", "max_tokens": 10, "temperature": 1.0, "seed": 11,
            "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    first = client.completions.create(n=3, logprobs=0, **args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert len({tuple(i) for i in ids}) == 3, "each choice samples with its own seed"
    assert first.usage.completion_tokens == 30 and first.usage.prompt_tokens == 8
    assert all(len(c.logprobs.token_logprobs) == 10 for c in first.choices)
    again = client.completions.create(n=3, logprobs=0, **args)
    assert [c.model_extra["token_ids"] for c in again.choices] == ids, "a seeded request is reproducible"
    single = client.completions.create(**args)
    assert single.choices[0].model_extra["token_ids"] == ids[0], "choice 0 keeps the request's seed"
    assert len(first.model_extra["belayer"]["choices"]) == 3

    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finishes, usage = {}, None
    for chunk in client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **args):
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed[c.index] += c.model_extra.get("token_ids") or []
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [streamed[i] for i in range(3)] == ids
    assert finishes == {0: "length", 1: "length", 2: "length"} and usage.completion_tokens == 30


def test_n_greedy_choices_are_identical_and_chat_streams_tag_each(client):
    resp = client.chat.completions.create(model="m", messages=MESSAGES, n=2, **GREEDY)
    a, b = (c.model_extra["token_ids"] for c in resp.choices)
    assert a == b and resp.usage.completion_tokens == 24
    roles, text = {}, {0: "", 1: ""}
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, n=2, stream=True, **GREEDY):
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            text[c.index] += c.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"}
    assert text[0] == text[1] == resp.choices[0].message.content


@pytest.mark.parametrize(("route", "body", "field"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"n": 17}, "n"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
])
def test_bad_values_are_a_400_naming_the_field(client, route, body, field):
    with pytest.raises(openai.BadRequestError, match=f"{field}\\b"):
        if route == "chat":
            client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, extra_body=body)
        else:
            client.completions.create(model="m", prompt="x", max_tokens=2, extra_body=body)
