"""Bounded fuzz of the OpenAI routes against a real engine (hypothesis, derandomized).

Bodies mix valid fields with arbitrary JSON values in every field. Every answer must be a
200 or a JSON 4xx with an error message; afterwards the engine serves the same greedy
tokens as before, with no handover, no exclusion and every KV block free.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from belayer_engine import RecoverableEngine
from belayer_engine.router import RouterConfig

from .test_router_hardening import AUTH, assert_healthy, call, chat, router

pytestmark = pytest.mark.timeout(900)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)
special = st.sampled_from(["<|im_start|>system\n", "<|im_end|>", "<|eos|>", "\ufffd", "\x00"])
valid_messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant"]),
    "content": st.text(max_size=24) | special | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2),
}), min_size=1, max_size=3)
VALID = {  # values the engine must serve (200)
    "model": st.text(max_size=8),
    "max_tokens": st.integers(1, 4),
    "temperature": st.sampled_from([0, 0.0, 0.7, 1e-300, 2.0]),
    "top_p": st.sampled_from([0.5, 1.0]),
    "top_k": st.sampled_from([-1, 1, 5]),
    "seed": st.sampled_from([0, 7, 2**63 - 1]),
    "stop": st.sampled_from(["\n", ["a", "b"], []]),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "n": st.sampled_from([1, 2]),
    "return_token_ids": st.booleans(),
    "logprobs": st.just(False),
    "presence_penalty": st.just(0),
}
INVALID = {  # per field, values that must be refused (as well as arbitrary JSON)
    "messages": st.sampled_from([[], ["hi"], [{"role": "tool", "content": "x"}], [{"role": "user"}], [{"role": "<|im_start|>", "content": "x"}]]),
    "prompt": st.sampled_from([[], [-1], [2**40], ["a", "b"], [True]]),
    "max_tokens": st.sampled_from([0, -1, True, "4", 1.5]),
    "temperature": st.sampled_from([-0.1, 2.5, True, "0"]),
    "top_p": st.sampled_from([0, 1.5]),
    "top_k": st.sampled_from([0, -2]),
    "seed": st.sampled_from([2**63, 2**64, -1, True]),
    "stop": st.sampled_from([5, "", [""], ["x"] * 20]),
    "stop_token_ids": st.sampled_from([[-1], ["x"]]),
    "n": st.sampled_from([0, 17, True]),
    "stream_options": st.just({"include_usage": True}),
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]),
    "tool_choice": st.just("auto"),
    "response_format": st.just({"type": "json_object"}),
    "logprobs": st.sampled_from([21, -1, "yes"]),
    "presence_penalty": st.just(0.5),
    "unknown_field": json_values,
}


@st.composite
def bodies(draw, chat: bool):
    """A valid body, and in about half the cases one field replaced by a bad value."""
    first = {"messages": valid_messages} if chat else {"prompt": st.text(min_size=1, max_size=16) | st.lists(st.integers(0, 511), min_size=1, max_size=6)}
    body = draw(st.fixed_dictionaries(first, optional=VALID))
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted({*first, *INVALID})))
        body[key] = draw(INVALID.get(key, json_values) | json_values)
    return body


chat_bodies, completion_bodies = bodies(chat=True), bodies(chat=False)


@pytest.fixture(scope="module")
def engine():
    with RecoverableEngine.launch(workers=1, shadow=True, router=RouterConfig(api_key=AUTH["Authorization"][7:], default_max_tokens=4)) as eng:
        eng.wait_ready(timeout=180)
        yield eng


SEEN: collections.Counter = collections.Counter()


def check(engine, path: str, body) -> None:
    status, out, ctype = call(router(engine), "POST", path, body, headers=AUTH)
    SEEN[status] += 1
    if status == 200:
        if isinstance(out, dict):
            assert out["choices"], out
        else:  # a stream: data lines, ending in [DONE] or an error event
            assert out.rstrip().endswith("data: [DONE]") or '"error"' in out, out[-300:]
        return
    assert 400 <= status < 500, (status, body, out)
    assert ctype.startswith("application/json") and out["error"]["message"], (status, body, out)


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_fuzzed_bodies_get_200_or_a_json_4xx_and_leave_the_engine_healthy(engine):
    since = len(engine.events())
    status, before = chat(engine)
    assert status == 200, before

    @FUZZ
    @given(body=chat_bodies)
    def chat_route(body):
        check(engine, "/v1/chat/completions", body)

    @FUZZ
    @given(body=completion_bodies)
    def completion_route(body):
        check(engine, "/v1/completions", body)

    @FUZZ
    @given(body=json_values)
    def any_json(body):
        check(engine, "/v1/chat/completions", body)
        check(engine, "/v1/completions", body)

    chat_route()
    completion_route()
    any_json()
    print("fuzz statuses:", dict(SEEN))
    assert SEEN[200] >= 5 and SEEN[400] >= 5, SEEN  # both paths were exercised
    assert set(SEEN) <= {200, 400}, SEEN  # 400, never another 4xx here, never a 5xx
    status, after = chat(engine)
    assert status == 200 and after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert after["belayer"]["recoveries"] == 0
    assert_healthy(engine, since)
