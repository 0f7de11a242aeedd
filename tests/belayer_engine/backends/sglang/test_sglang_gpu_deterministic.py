"""On a GPU, with SGLang's deterministic inference mode: what a SIGKILL of the serving
SGLang server mid-stream leaves the client with.

Asserted (holds): every id the client had before the kill is the fault-free run's, the
response is complete (no id lost or duplicated), and it reports how many generated ids were
re-prefilled. Token identity after the kill is checked and reported as an expected failure:
on the H200 with SGLang 0.5.17 (triton attention, `--enable-deterministic-inference`) the
continuation differed from the fault-free run 4 ids after a kill at id 24 (the mode makes
decode batch-invariant, but a re-prefill runs the extend kernel, which sums in another
order than the decode kernel that produced the uninterrupted run). GPU only: CI has no GPU,
so it is skipped there. On the H200:

    BELAYER_TEST_DEVICE=cuda:0 BELAYER_TEST_MODEL_DIR=DIR bash benchmarks/sglang_gpu_env.sh \\
        python3 -m pytest -q --noconftest tests/belayer_engine/backends/sglang/test_sglang_gpu_deterministic.py

(DIR: a Qwen3-4B-shaped model; without it the embedded model in bf16. `--noconftest`: the
image has no `docker` package, which the suite's top conftest imports.)
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from belayer_engine.client import EngineClient
from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig

from .conftest import sglang_venv

DEVICE = os.environ.get("BELAYER_TEST_DEVICE", "cpu")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="GPU only (BELAYER_TEST_DEVICE=cuda:N)")]

PROMPT = "The belay device holds the rope when"
MAX_TOKENS = 160
KILL_AT = (24, 97)  # one kill at each: early and past the 67 tokens where the default mode drifted


async def _greedy(base_url: str, kill_pid: int | None = None, kill_at: int = 0) -> tuple[list[int], dict]:
    ids: list[int] = []
    summary: dict = {}
    async with EngineClient(base_url) as client:
        async for chunk in client.stream_complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
            for choice in chunk["choices"]:
                ids += choice.get("token_ids", [])
                if kill_pid is not None and len(ids) >= kill_at:
                    os.kill(kill_pid, signal.SIGKILL)
                    kill_pid = None
                if choice.get("finish_reason"):
                    summary = chunk.get("belayer", {})
    return ids, summary


def test_sigkill_mid_stream_gives_the_fault_free_greedy_ids():
    router = RouterConfig(request_wait_s=900, stall_timeout_s=120.0)
    with RecoverableEngine.launch(backend="sglang", sglang_venv=sglang_venv(), device=DEVICE, router=router,
                                  model=os.environ.get("BELAYER_TEST_MODEL_DIR") or None, start_timeout_s=900,
                                  worker_args=["--enable-deterministic-inference"]) as eng:
        eng.wait_ready(timeout=900)
        want, _ = asyncio.run(_greedy(eng.base_url))
        assert len(want) == MAX_TOKENS
        for kill_at in KILL_AT:
            eng.wait_ready(timeout=900, stable=True)  # the shadow of the last handover re-armed
            got, summary = asyncio.run(_greedy(eng.base_url, eng.worker_pid(0), kill_at))
            assert summary["recoveries"] == 1, summary
            at = summary["failures"][0]["at_token"]
            assert summary["reprefilled_tokens"] == at >= kill_at, summary
            assert len(got) == MAX_TOKENS and got[:at] == want[:at], summary  # nothing lost, nothing repeated
            mismatch = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            if mismatch is not None:
                pytest.xfail(f"kill at {at}: first differing id at {mismatch} of {len(want)} (re-prefill is not "
                             "bit-identical to decode in SGLang's deterministic mode)")
