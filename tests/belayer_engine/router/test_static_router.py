"""``belayer serve router --worker A --worker B`` (no supervisor) survives a worker SIGKILL.

The documented path for real SGLang servers (docs/training.md, "Real SGLang servers"):
plain SGLang-protocol workers started on their own, the router CLI in front of them,
probing ``/health`` itself. Here the workers are our reference workers with the same
(seeded) weights. An arena grants its live KV to one worker at a time, so each worker
has its own arena, as each SGLang server owns its own GPU. The serving worker is
SIGKILLed mid-stream; the stream must finish on the other worker token-identical to a
fault-free greedy run (nothing lost, nothing sent twice) with one recovery recorded.
"""

from __future__ import annotations

import signal

import openai
import pytest

from belayer_engine.router.codec import load_codec
from tests.belayer_engine.conftest import Arena, Worker
from tests.belayer_engine.router.router_cli import RouterCLI, _url, _wait_live

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "How does a belay device hold a fall?"}]
# ignore_eos and a long budget (~1.5 s of decoding on an idle CPU) so that the kill lands
# mid-generation even when the client reads far behind the worker on a loaded machine.
MAX_TOKENS = 512
KILL_AT = 4  # tokens the client has received before the serving worker is killed
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0,
          "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def test_static_router_cli_survives_sigkill_mid_stream(tmp_path, procs):
    workers = []
    for name in ("a", "b"):
        arena_dir = tmp_path / name
        arena_dir.mkdir()
        procs.append(arena := Arena(arena_dir))  # same default seed: identical weights
        procs.append(worker := Worker(arena, arena_dir, name=name))
        workers.append(worker)
    by_url = {_url(w): w for w in workers}

    router = RouterCLI(list(by_url), tmp_path / "router.log")
    procs.append(router)
    slots = _wait_live(router, 2)
    assert sorted(ep["url"] for ep in slots.values()) == sorted(by_url)

    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120)

    # Fault-free greedy reference through the router, and the same on each worker directly:
    # both workers must agree, or a token-identical continuation could not be expected.
    want = client.chat.completions.create(model="m", messages=MESSAGES, **GREEDY)
    want_ids = want.choices[0].model_extra["token_ids"]
    assert len(want_ids) == MAX_TOKENS, "ignore_eos should give a full-length output"
    assert want.model_extra["belayer"]["recoveries"] == 0
    prompt_ids = load_codec(None).render_chat(MESSAGES)
    for w in workers:
        direct = w.generate(prompt_ids, MAX_TOKENS, ignore_eos=True)["output_ids"]
        assert direct == want_ids, f"worker {_url(w)} disagrees with the router's fault-free output"

    # Stream, and SIGKILL whichever worker the router is streaming from once KILL_AT tokens arrived.
    ids, text, usage, summary, victim = [], "", None, None, None
    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    for chunk in stream:
        usage = chunk.usage or usage
        summary = (chunk.model_extra or {}).get("belayer") or summary
        for choice in chunk.choices:
            ids += (choice.model_extra or {}).get("token_ids") or []
            text += choice.delta.content or ""
        if victim is None and len(ids) >= KILL_AT:
            serving = [(slot, ep) for slot, ep in router.live_slots().items() if ep["inflight"] > 0]
            assert len(serving) == 1, f"expected exactly one worker serving the stream: {serving}"
            victim_slot, ep = serving[0]
            victim = by_url[ep["url"]]
            victim.kill9()  # os.kill(pid, SIGKILL), then reaped: it is really gone
    assert victim is not None, f"the stream ended after {len(ids)} tokens, before the kill"
    assert summary is not None, "the final chunk carries no belayer record"
    assert summary["recoveries"] >= 1, f"the worker finished before it was killed (raise MAX_TOKENS?): {summary}"
    assert victim.p.returncode == -signal.SIGKILL

    # The property that matters: one uninterrupted stream, token-identical to the fault-free run.
    assert ids == want_ids, (f"stream differs from the fault-free greedy output "
                             f"(got {len(ids)} tokens, want {len(want_ids)}); belayer: {summary}")
    assert text == want.choices[0].message.content
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert summary["recoveries"] == 1, summary
    assert summary["regenerated_tokens"] == 0 and not summary["diverged"], summary
    survivor = next(w for w in workers if w is not victim)
    survivor_slot = next(slot for slot, ep in slots.items() if ep["url"] == _url(survivor))
    assert [w.split("#")[0] for w in summary["workers"]] == [victim_slot, survivor_slot], summary
    (failure,) = summary["failures"]
    assert KILL_AT <= failure["at_token"] < MAX_TOKENS, failure
    assert summary["reprefilled_tokens"] == failure["at_token"], summary  # every id so far went back as input
    # where the recovery's wait went: failure seen, request re-sent, the survivor's answer
    # started (its HTTP side took the request), its first token
    assert failure["t"] <= failure["resent_t"] <= failure["headers_t"] <= failure["first_token_t"], failure

    # The dead worker is out of routing (it does not answer /health); the survivor serves.
    live = _wait_live(router, 1)
    assert list(live) == [survivor_slot] and live[survivor_slot]["url"] == _url(survivor)
    after = client.chat.completions.create(model="m", messages=MESSAGES, **GREEDY)
    assert after.choices[0].model_extra["token_ids"] == want_ids
    record = after.model_extra["belayer"]
    assert record["recoveries"] == 0 and [w.split("#")[0] for w in record["workers"]] == [survivor_slot], record


def test_router_cli_stops_gracefully_once_ready(tmp_path):
    """SIGTERM right after the JSON line is a clean shutdown (exit 0), not death by signal.

    The line means "ready": a supervisor or script may stop the router the moment it has
    read it, so the signal handlers must already be in place when it is printed.
    """
    router = RouterCLI(["http://127.0.0.1:9"], tmp_path / "router.log")  # no worker needed
    try:
        router.p.terminate()
        rc = router.p.wait(timeout=30)
        assert rc == 0, f"router exited with {rc} (negative: killed by that signal), not 0; log:\n{router._output()}"
    finally:
        router.stop()
