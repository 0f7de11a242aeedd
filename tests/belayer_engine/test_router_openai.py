"""The router speaks OpenAI to clients and SGLang /generate to real worker processes."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from belayer_engine.client import EngineClient
from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig

pytestmark = pytest.mark.timeout(240)

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "Say something about ropes."}]


@pytest.fixture(scope="module")
def engine():
    with RecoverableEngine.launch(workers=1, shadow=False, router=RouterConfig(api_key=KEY)) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=engine.base_url, api_key=KEY, max_retries=0)


async def _direct_generate(url: str, input_ids: list[int], max_new_tokens: int, headers: dict) -> list[int]:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    async with aiohttp.ClientSession(headers=headers) as s, s.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return list((await resp.json())["output_ids"])


def test_models_and_health(engine, client):
    assert [m.id for m in client.models.list().data] == ["belayer-default"]

    async def health(headers):
        async with aiohttp.ClientSession(headers=headers) as s, s.get(engine.base_url.removesuffix("/v1") + "/health") as r:
            return r.status, await r.json()

    status, body = asyncio.run(health({"Authorization": f"Bearer {KEY}"}))
    assert status == 200 and body["workers"] == 1
    assert asyncio.run(health({})) == (200, {"status": "ok"})  # without the key: no detail


def test_chat_matches_worker_and_counts_usage(engine, client):
    resp = client.chat.completions.create(
        model="belayer-default", messages=MESSAGES, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = resp.choices[0]
    ids = choice.model_extra["token_ids"]
    assert resp.usage.completion_tokens == len(ids) > 0
    assert choice.finish_reason in ("stop", "length")
    # The same prompt ids sent straight to the worker give the same greedy tokens.
    from belayer_engine.router.codec import load_codec

    prompt_ids = load_codec(None).render_chat(MESSAGES)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    url = engine.status()["slots"]["w0"]["worker_url"]
    assert asyncio.run(_direct_generate(url, prompt_ids, 24, engine.worker_headers())) == ids
    assert choice.message.content == load_codec(None).decode(ids)


def test_streaming_chat_equals_non_streaming(client):
    full = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    text, usage, finishes = "", None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finishes.append(c.finish_reason)
    assert text == full.choices[0].message.content
    assert usage.completion_tokens == full.usage.completion_tokens
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])


def test_completions_text_and_token_prompt(client):
    a = client.completions.create(model="m", prompt="The rope", max_tokens=16, temperature=0, extra_body={"return_token_ids": True})
    prompt_ids = list(b"The rope")
    b = client.completions.create(model="m", prompt=prompt_ids, max_tokens=16, temperature=0, extra_body={"return_token_ids": True})
    assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]
    assert a.choices[0].text == b.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="m", prompt="The rope", max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == a.choices[0].text


def test_api_key_and_bad_requests(engine, client):
    bad = openai.OpenAI(base_url=engine.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="m", messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="n: "):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, n=17)
    # The router still serves after rejecting bad input.
    assert client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, temperature=0).choices


def test_async_client_helper(engine):
    async def go():
        async with EngineClient(engine.base_url, api_key=KEY) as c:
            full = await c.chat(MESSAGES, max_tokens=16, temperature=0)
            ids = []
            async for chunk in c.stream_chat(MESSAGES, max_tokens=16, temperature=0):
                ids += chunk["choices"][0].get("token_ids", []) if chunk["choices"] else []
            return full, ids

    full, ids = asyncio.run(go())
    assert full.token_ids == ids and full.usage["completion_tokens"] == len(ids)
    assert full.belayer["recoveries"] == 0


def test_stop_strings_are_honoured(client):
    full = client.completions.create(model="m", prompt="The rope", max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = next((c for c in text[3:] if c.isprintable() and c != "\ufffd"), None)
    if stop is None:
        pytest.skip("the seeded model produced no printable character to stop on")
    cut = client.completions.create(model="m", prompt="The rope", max_tokens=32, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_static_router_fronts_any_sglang_worker(engine):
    """Without a supervisor the router probes the workers itself (e.g. real SGLang servers).

    A stall timeout far below the token interval shows that a slow but healthy worker
    (it answers /health) is never treated as stalled.
    """
    from belayer_engine.router import Router

    worker_url = engine.status()["slots"]["w0"]["worker_url"]

    async def go():
        secret = engine.worker_headers()["Authorization"].removeprefix("Bearer ")
        router = Router(RouterConfig(probe_interval_s=0.05, stall_timeout_s=0.005, worker_api_key=secret))
        router.add_static_workers([worker_url])
        base = await router.start()
        try:
            async with EngineClient(base + "/v1") as c:
                got = await c.complete("The rope", max_tokens=24, temperature=0)
            async with EngineClient(engine.base_url, api_key=KEY) as c:
                want = await c.complete("The rope", max_tokens=24, temperature=0)
        finally:
            await router.stop()
        return got, want

    got, want = asyncio.run(go())
    assert got.token_ids == want.token_ids
    assert got.belayer["recoveries"] == 0 and len(got.belayer["workers"]) == 1 and got.belayer["workers"][0].startswith("s0#")
