"""Logprobs across a failover: SIGKILL the serving reference worker mid-stream (token-level
recovery through the static router with n=2, and chunk-level recovery in an engine).

Two reference workers with the same (seeded) weights behind ``belayer serve router``
(the static-router set-up of test_static_router.py). A streamed greedy chat request with
``logprobs`` and ``n=2`` loses its worker; the router continues each choice on the other
worker, which scores the tokens it generates. Each choice must read as one generation:
token ids equal to the fault-free run, one logprob (and one top list) per token, and the
values equal to the fault-free run's within ``TOL``.

Why a tolerance: the continued part's first token comes from the new worker's prefill of
prompt + generated ids, a forward pass of another shape (many rows) than the fault-free
run's one-row decode step, which may sum in another order. On this CPU worker the values
came out bit-equal (max difference 0.0); ``TOL`` = 1e-4 allows float32 rounding (an
accelerator's kernels pick shape-dependent reductions) while still catching a misaligned or
misattributed entry (neighbouring tokens' logprobs differ by far more). With two workers
the router may put the choices on different workers: the one on the killed worker
recovers, the other is untouched, and both must read the same.
"""

from __future__ import annotations

import os
import signal

import openai
import pytest

from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig
from tests.belayer_engine.conftest import Arena, Worker
from tests.belayer_engine.router.router_cli import RouterCLI, _url, _wait_live

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "How does a belay device hold a fall?"}]
MAX_TOKENS = 512  # ~1.5 s of decoding on an idle CPU: the kill lands mid-generation
KILL_AT = 4
TOP = 2
TOL = 1e-4
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": TOP,
          "extra_body": {"ignore_eos": True, "return_token_ids": True}}


def test_logprobs_survive_a_sigkill_mid_stream_for_every_choice(tmp_path, procs):
    workers = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        procs.append(arena := Arena(d))
        procs.append(worker := Worker(arena, d, name=name))
        workers.append(worker)
    by_url = {_url(w): w for w in workers}
    router = RouterCLI(list(by_url), tmp_path / "router.log")
    procs.append(router)
    _wait_live(router, 2)
    client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120)

    want = client.chat.completions.create(model="m", messages=MESSAGES, **GREEDY).choices[0]
    want_ids = want.model_extra["token_ids"]
    want_lps = [e.logprob for e in want.logprobs.content]
    want_tops = [[(t.token, t.logprob) for t in e.top_logprobs] for e in want.logprobs.content]
    assert len(want_ids) == len(want_lps) == MAX_TOKENS

    ids = {0: [], 1: []}
    content = {0: [], 1: []}
    summaries, usage, victim = {}, None, None
    stream = client.chat.completions.create(model="m", messages=MESSAGES, n=2, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            ids[c.index] += (c.model_extra or {}).get("token_ids") or []
            content[c.index] += c.logprobs.content if c.logprobs else []
            if c.finish_reason:
                summaries[c.index] = chunk.model_extra["belayer"]
        if victim is None and min(len(v) for v in ids.values()) >= KILL_AT:
            serving = [ep for ep in router.live_slots().values() if ep["inflight"] > 0]
            assert serving, "no worker is serving the stream"
            victim = by_url[serving[0]["url"]]
            victim.kill9()
    assert victim is not None and victim.p.returncode == -signal.SIGKILL
    assert sorted(summaries) == [0, 1], summaries
    assert sum(s["recoveries"] for s in summaries.values()) >= 1, f"the kill landed after the end: {summaries}"
    assert usage.completion_tokens == 2 * MAX_TOKENS

    for i in (0, 1):
        got_lps = [e.logprob for e in content[i]]
        got_tops = [[(t.token, t.logprob) for t in e.top_logprobs] for e in content[i]]
        assert ids[i] == want_ids, f"choice {i}: ids differ from the fault-free run; {summaries[i]}"
        assert len(got_lps) == len(got_tops) == MAX_TOKENS, f"choice {i}: logprob entries lost or duplicated"
        assert [e.token for e in content[i]] == [e.token for e in want.logprobs.content]
        worst = max(abs(a - b) for a, b in zip(got_lps, want_lps, strict=True))
        assert worst <= TOL, f"choice {i}: logprobs differ by up to {worst:.2e}; {summaries[i]}"
        for got, ref in zip(got_tops, want_tops, strict=True):
            assert [t for t, _ in got] == [t for t, _ in ref]
            assert all(abs(a - b) <= TOL for (_, a), (_, b) in zip(got, ref, strict=True))
        for failure in summaries[i]["failures"]:
            assert KILL_AT <= failure["at_token"] < MAX_TOKENS, failure
        print(f"choice {i}: recoveries={summaries[i]['recoveries']} max |logprob - fault-free| = {worst:.2e}")


def test_chunk_mode_keeps_one_logprob_per_token_across_a_sigkill():
    """Coarse recovery re-generates the tail since the last k-token boundary and suppresses
    what the client already has: its logprobs are dropped with it (the client keeps the
    first worker's), so the lists stay one entry per token."""
    long = 256
    args = {"model": "m", "prompt": "The rope holds", "max_tokens": long, "temperature": 0, "logprobs": 1,
            "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    with RecoverableEngine.launch(workers=1, shadow=True, router=RouterConfig(recovery="chunk", chunk_tokens=16)) as eng:
        eng.wait_ready(timeout=120)
        client = openai.OpenAI(base_url=eng.base_url, api_key="unused", max_retries=0, timeout=120)
        want = client.completions.create(**args).choices[0]
        pid = eng.worker_pid(0)
        ids, lps, summary, killed = [], [], None, False
        for chunk in client.completions.create(stream=True, **args):
            for c in chunk.choices:
                ids += c.model_extra.get("token_ids") or []
                lps += c.logprobs.token_logprobs if c.logprobs else []
                summary = chunk.model_extra.get("belayer") or summary
            if not killed and len(ids) >= 21:
                os.kill(pid, signal.SIGKILL)
                killed = True
    assert killed and summary["recoveries"] == 1, summary
    assert ids == want.model_extra["token_ids"] and len(lps) == len(ids) == long
    assert max(abs(a - b) for a, b in zip(lps, want.logprobs.token_logprobs, strict=True)) <= TOL
    assert summary["regenerated_tokens"] == summary["failures"][0]["at_token"] % 16, summary
