"""Chaos: real worker processes killed by real signals at random points mid-stream.

Every request must complete token-identical to the fault-free greedy output (zero lost,
zero duplicated tokens), the handover must go through the shadow, and the shadow must be
re-armed after each failure. Waits are bounded and say what they waited for.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import pytest

from belayer_core.errors import WorkerLost
from belayer_engine.client import EngineClient
from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["Once upon a time", "The belay device", "def climb(route):", "Knots: bowline, clove"]
MAX_TOKENS = 48


async def stream_ids(client: EngineClient, prompt: str, on_token=None,
                     max_tokens: int = MAX_TOKENS) -> tuple[list[int], dict, str]:
    ids: list[int] = []
    summary: dict = {}
    finish = ""
    async for chunk in client.stream_complete(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        for choice in chunk["choices"]:
            ids += choice.get("token_ids", [])
            if on_token:
                on_token(len(ids))
            if choice.get("finish_reason"):
                summary, finish = chunk.get("belayer", {}), choice["finish_reason"]
    return ids, summary, finish


async def run_round(base_url: str, prompts: list[str], trigger_at: int | None = None, fire=None,
                    max_tokens: int = MAX_TOKENS):
    """Stream all prompts concurrently; call ``fire()`` once prompt 0 has ``trigger_at`` tokens."""
    fired = []

    def on_token(n: int) -> None:
        if fire is not None and not fired and n >= trigger_at:
            fired.append(n)
            fire()

    async with EngineClient(base_url) as client:
        results = await asyncio.gather(*(stream_ids(client, p, on_token if i == 0 else None, max_tokens)
                                         for i, p in enumerate(prompts)))
    if fire is not None:
        assert fired, f"the fault was never injected (prompt 0 streamed fewer than {trigger_at} tokens)"
    return results


def fault_free(base_url: str) -> dict[str, list[int]]:
    return {p: ids for p, (ids, _, _) in zip(PROMPTS, asyncio.run(run_round(base_url, PROMPTS)), strict=True)}


def handovers(engine) -> int:
    return engine.status()["slots"]["w0"]["handovers"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    router = RouterConfig(stall_timeout_s=1.5, stall_probe_timeout_s=1.0)
    run_dir = tmp_path_factory.mktemp("chaos-engine")  # worker logs outlive the engine (failure reports)
    with RecoverableEngine.launch(workers=1, shadow=True, router=router, unhealthy_window_s=0.5,
                                  run_dir=str(run_dir)) as eng:
        eng.wait_ready(timeout=120)
        yield eng


def _proc_state(pid: int) -> str:
    """What the kernel says about ``pid``: run state and signal masks (or that it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return f"pid {pid}: gone"
    keep = ("State", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    return f"pid {pid}: " + ", ".join(line.replace("\t", " ") for line in lines if line.split(":")[0] in keep)


def _worker_log(engine, pid: int, n: int = 3000) -> str:
    """The tail of the log of the worker or shadow that announced ``pid`` (in the engine's run_dir)."""
    run_dir = Path(engine.supervisor_config.run_dir or "")
    for log in sorted(run_dir.glob("w*-*.log")):
        text = log.read_text(errors="replace")
        if f'"pid": {pid},' in text:
            return f"{log}:\n{text[-n:]}"
    return f"no log in {run_dir} announced pid {pid}"


def _diagnosis(engine, pid: int, t0: float) -> str:
    events = [e for e in engine.events() if e["t"] >= t0 - 1]
    return (f"{_proc_state(pid)}\nsupervisor events since the signal: {events}\n"
            f"status: {engine.status()['slots']}\nworker log: {_worker_log(engine, pid)}")


@pytest.fixture(scope="module")
def baseline(engine):
    base = fault_free(engine.base_url)
    assert all(len(ids) == MAX_TOKENS for ids in base.values()), "ignore_eos should give full-length outputs"
    assert fault_free(engine.base_url) == base, "greedy decoding must be deterministic without faults"
    return base


FAULTS = [signal.SIGKILL, signal.SIGSEGV, signal.SIGSTOP]


def test_signals_mid_stream_token_identical(engine, baseline):
    rng = random.Random(20261129)
    _signal_rounds(engine, baseline, rng, FAULTS + rng.sample(FAULTS * 2, 2 * len(FAULTS)))  # each kind 3 times


def test_sigint_mid_stream_drains_and_hands_over(engine, baseline):
    """SIGINT: the worker drains (at most DRAIN_S, then what still runs is cut and continued on
    the shadow) and exits with 0; the shadow takes over, token-identical."""
    _signal_rounds(engine, baseline, random.Random(20261130), [signal.SIGINT] * 3)


def _signal_rounds(engine, baseline, rng: random.Random, schedule: list[signal.Signals]) -> None:
    for round_no, sig in enumerate(schedule):
        engine.wait_ready(timeout=120, stable=True)
        status = engine.status()["slots"]["w0"]
        pid, shadow_pid, before = status["worker_pid"], status["shadow_pid"], status["handovers"]
        trigger = rng.randint(1, MAX_TOKENS - 8)
        t0 = time.monotonic()
        results = asyncio.run(run_round(engine.base_url, PROMPTS, trigger, lambda: os.kill(pid, sig)))  # noqa: B023
        for prompt, (ids, summary, finish) in zip(PROMPTS, results, strict=True):
            assert ids == baseline[prompt], f"round {round_no} ({sig.name} at token {trigger}): {prompt!r} differs: {summary}"
            assert finish == "length"
        if sig != signal.SIGINT:  # a clean exit may drain its streams before leaving
            assert any(s["recoveries"] >= 1 for _, s, _ in results), f"round {round_no}: no request was recovered"
        try:
            handover = engine.wait_event("handover", since=t0, timeout=60)  # a clean exit may drain first
        except WorkerLost as exc:
            pytest.fail(f"round {round_no} ({sig.name} at token {trigger}): {exc}\n{_diagnosis(engine, pid, t0)}")
        engine.wait_ready(timeout=120)
        after = engine.status()["slots"]["w0"]
        detected = [e for e in engine.events() if e["event"] == "detected" and e["t"] >= t0]
        # A clean exit is seen by whichever detector is first: its exit, refused connections, probes.
        assert [e["pid"] for e in detected] == [pid], f"round {round_no} ({sig.name}): {detected}"
        assert handover["path"] == "shadow" and after["handovers"] == before + 1, f"round {round_no}: {engine.events()[-6:]}"
        assert after["worker_pid"] == shadow_pid, "the pre-armed shadow must take over"
        assert after["shadow_pid"] not in (None, pid, shadow_pid), "a fresh shadow must be re-armed"
        if sig == signal.SIGINT:  # it drained (it may be fenced before it exits: probes fail once it stops listening)
            assert '"event": "draining"' in _worker_log(engine, pid), _diagnosis(engine, pid, t0)
            assert all(e["reason"] == "worker exited with 0" for e in detected if e["source"] == "exit"), detected
    paths = [e["path"] for e in engine.events() if e["event"] == "handover"]
    assert set(paths) == {"shadow"}


def test_chunk_mode_regenerates_but_never_duplicates():
    """Coarse recovery (prefix preserved every k tokens): regenerated, never sent twice."""
    long = 8 * MAX_TOKENS  # long enough that the kill at token 21 always lands mid-generation
    with RecoverableEngine.launch(workers=1, shadow=True, router=RouterConfig(recovery="chunk", chunk_tokens=16)) as eng:
        eng.wait_ready(timeout=120)
        want = asyncio.run(run_round(eng.base_url, PROMPTS[:1], max_tokens=long))[0][0]
        pid = eng.worker_pid(0)
        trigger = 21
        results = asyncio.run(run_round(eng.base_url, PROMPTS[:1], trigger, lambda: os.kill(pid, signal.SIGKILL),
                                        max_tokens=long))
    ids, summary, _ = results[0]
    assert len(want) == long and ids == want
    assert summary["recoveries"] == 1
    assert summary["regenerated_tokens"] == summary["failures"][0]["at_token"] % 16


def test_openai_sdk_stream_survives_sigkill(engine, baseline):
    """The official SDK, unchanged, sees one uninterrupted stream across a handover."""
    import openai

    client = openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0)
    engine.wait_ready(timeout=120, stable=True)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    want = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    pid, t0 = engine.worker_pid(0), time.monotonic()
    ids, text, killed = [], "", False
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        for choice in chunk.choices:
            ids += (choice.model_extra or {}).get("token_ids", [])
            text += choice.delta.content or ""
        if len(ids) >= 10 and not killed:
            os.kill(pid, signal.SIGKILL)
            killed = True
    assert killed
    assert ids == want.choices[0].model_extra["token_ids"] and text == want.choices[0].message.content
    assert engine.wait_event("handover", since=t0, timeout=60)["path"] == "shadow"
