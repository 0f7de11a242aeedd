"""Tensor-parallel SGLang servers (tp=2, CPU ranks) as worker and shadow: both map the
arena's per-rank shards (one copy of the weights for every rank of both servers), an update
reaches every rank at one version, a SIGKILL of one rank process fences the whole group and
the shadow group continues every in-flight stream with the fault-free ids, and a stopped
rank (SIGSTOP) is caught by the same stall detection as a stopped server.

One engine for the module (tests run in file order and build on its state), the default
recovery (the shadow re-prefills prompt + ids so far; sglang_kv='server' at tp > 1).
"""

from __future__ import annotations

import os
import signal
from functools import partial

import openai
import pytest
from safetensors.torch import load_file

from belayer_engine.arena.client import ArenaClient
from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig
from tests.conftest import wait_until

from .conftest import sglang_venv, streams_across

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPTS = ["Two ranks hold the rope", "Each rank holds half the heads"]
HELD_TOKENS = 64
START_S = 600.0
# No token for this long: the router probes the server (a stopped rank never answers). Above
# the paced start of the streams (HoldServer runs the group at 5% of a core until each has 4
# ids): 10-11 s on a quiet 2-core VM; in one full-suite run a stream waited over 20 s there, so the
# router took the paced server for a stalled one before the fault.
STALL_S = 45.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    router = RouterConfig(request_wait_s=START_S, stall_timeout_s=STALL_S)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BELAYER_SHM_DIR", str(tmp_path_factory.mktemp("shm")))
        with RecoverableEngine.launch(backend="sglang", sglang_venv=sglang_venv(), start_timeout_s=START_S,
                                      router=router, worker_args=["--tp-size", "2"]) as eng:
            eng.wait_ready(timeout=START_S, stable=True)
            yield eng


def _client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0, timeout=START_S)


def _complete(engine, prompt: str, **options) -> openai.types.Completion:
    return _client(engine).completions.create(
        model="belayer-default", prompt=prompt, max_tokens=HELD_TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}, **options)


def _ids(engine, prompt: str) -> list[int]:
    return list(_complete(engine, prompt).choices[0].model_extra["token_ids"])


def _stream(engine, prompt: str, on_tokens, out: dict) -> None:
    ids, belayer = [], None
    for chunk in _client(engine).completions.create(
            model="belayer-default", prompt=prompt, max_tokens=HELD_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True}):
        ids.extend((chunk.choices[0].model_extra.get("token_ids") or []) if chunk.choices else [])
        if len(ids) >= 4:
            on_tokens(len(ids))
        belayer = chunk.model_extra.get("belayer") or belayer
    out.update(ids=ids, belayer=belayer)


def _ranks(engine) -> dict[int, str]:
    slot = engine.supervisor.slots[0]
    return engine.supervisor._procs.members(slot.worker)


def _streams_across(engine, fault) -> tuple[list[dict], dict]:
    """PROMPTS streamed while ``fault(ranks)`` hits the serving server once each stream has
    tokens; returns the results and the fault-free ids of each prompt."""
    expected = {p: _ids(engine, p) for p in PROMPTS}
    engine.wait_ready(timeout=START_S, stable=True)
    ranks = _ranks(engine)
    assert sorted(ranks.values()) == ["sglang::detokenizer", "sglang::scheduler_TP0", "sglang::scheduler_TP1"]
    results, _ = streams_across(engine, [partial(_stream, engine, p) for p in PROMPTS],
                             partial(fault, {title: pid for pid, title in ranks.items()}), START_S)
    return results, expected


def _assert_continued(engine, results, expected, old_pid: int) -> dict:
    events = [e for e in engine.events() if e["event"] in ("detected", "fenced", "handover")]
    for p, res in zip(PROMPTS, results, strict=True):
        assert res["ids"] == expected[p], f"{p!r}: the shadow group's continuation differs; {events}"
    assert sum(r["belayer"]["recoveries"] for r in results) >= 1, events
    wait_until(lambda: engine.worker_pid(0) not in (None, old_pid), 60, "the shadow group took over")
    detected = [e for e in engine.events() if e["event"] == "detected" and e["pid"] == old_pid]
    assert detected, events
    return detected[-1]


def test_both_servers_map_every_ranks_shard_and_an_update_reaches_all_ranks(engine):
    arena = ArenaClient(engine.arena_socket())
    cache = arena.weight_cache()
    # two ranks of the worker and two of the shadow fetched their shard: no rank read the disk
    # (a shadow start that failed and was retried, as two tp=2 servers starting together on a
    # loaded 2-core machine can, adds at most its two ranks' fetches)
    retried = sum(e["event"] == "shadow_failed" for e in engine.events())
    assert cache["tp_size"] == 2 and 4 <= cache["fetches"] <= 4 + 2 * retried, (cache, retried)
    before = {p: _ids(engine, p) for p in PROMPTS}
    lm_head = load_file(ensure_embedded_model() / "model.safetensors")["lm_head.weight"]
    version = engine.update_weights({"lm_head.weight": lm_head.flip(0)})  # rows split over the ranks
    assert _complete(engine, PROMPTS[0]).model_extra["belayer"]["weight_version"] == version
    after = _complete(engine, PROMPTS[0], logprobs=2, n=2)
    a, b = (c.model_extra["token_ids"] for c in after.choices)
    assert a == b != before[PROMPTS[0]], "both greedy choices see the new vocabulary rows on both ranks"
    assert len(after.choices[0].logprobs.top_logprobs) == HELD_TOKENS
    assert engine.update_weights({"lm_head.weight": lm_head}) > version
    assert {p: _ids(engine, p) for p in PROMPTS} == before, "the old weights back on every rank"


def test_a_sigkilled_rank_fences_the_whole_group_and_the_streams_continue(engine):
    old_pid = engine.worker_pid(0)
    members = _ranks(engine)
    results, expected = _streams_across(engine, lambda ranks: os.kill(ranks["sglang::scheduler_TP1"], signal.SIGKILL))
    detected = _assert_continued(engine, results, expected, old_pid)
    assert detected["source"] == "exit" and "sglang::scheduler_TP1" in detected["reason"], detected
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in [old_pid, *members]), 60,
               "every process of the killed group gone")


def test_a_stopped_rank_is_caught_like_a_stopped_server(engine):
    old_pid = engine.worker_pid(0)

    def stop_rank0(ranks):
        os.kill(ranks["sglang::scheduler_TP0"], signal.SIGSTOP)
        for title, pid in ranks.items():  # everything else runs on (HoldServer stopped the group)
            if title != "sglang::scheduler_TP0":
                os.kill(pid, signal.SIGCONT)
        os.kill(old_pid, signal.SIGCONT)

    results, expected = _streams_across(engine, stop_rank0)
    detected = _assert_continued(engine, results, expected, old_pid)
    # no process exited: the router saw no token for STALL_S and the server's /health unanswered
    assert detected["source"] == "router" and "stalled" in detected["reason"], detected
