"""An error inside one request ends that request alone (issue 12): the batch goes on.

The scheduler runs with the real model and KV arena; the faulty requests bypass the
worker's validation (``model_construct``) to reach the scheduler's own failure paths: a
seed torch refuses (admission), a NaN temperature (sampling), a token id outside the
vocabulary (the batched forward call fails; each request is re-run alone).
"""

from __future__ import annotations

import threading

import pytest
import torch

from belayer_engine.backends.reference.model import Qwen3Model
from belayer_engine.backends.reference.sampling import SamplingParams
from belayer_engine.backends.reference.scheduler import BatchScheduler, Request
from belayer_engine.model.config import ModelConfig, kv_shape
from belayer_engine.model.tokenizer import ByteTokenizer
from belayer_engine.model.weights import init_weights

torch.set_num_threads(1)
CFG = ModelConfig()
W = init_weights(CFG, 0)
NUM_BLOCKS = 64
GOOD = [([1, 2, 3, 4, 5], 12), ([300, 12, 99, 7], 12)]


def run(jobs: list[tuple[list[int], SamplingParams]]) -> tuple[list[dict], BatchScheduler]:
    """Submit all jobs in one go (so they share scheduler steps); each job's last event."""
    sched = BatchScheduler(Qwen3Model(CFG, W, exact=True), ByteTokenizer(CFG.vocab_size), block_size=8)
    sched.set_weights(0, W)
    sched.attach_kv(torch.zeros(kv_shape(CFG, NUM_BLOCKS, 8)))
    last: list[dict | None] = [None] * len(jobs)
    done = threading.Semaphore(0)

    def emitter(i):
        def emit(ev):
            if ev["finish_reason"] is not None:
                last[i] = ev
                done.release()
        return emit

    for i, (ids, params) in enumerate(jobs):
        sched.submit(Request(f"r{i}", ids, params, emitter(i)))
    sched.start()
    try:
        for _ in jobs:
            assert done.acquire(timeout=120), f"not every request finished: {last}"
    finally:
        sched.stop()
    return last, sched


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def solo() -> list[list[int]]:
    return [run([(ids, greedy(n))])[0][0]["output_ids"] for ids, n in GOOD]


@pytest.mark.parametrize(("bad_ids", "bad_params", "status"), [
    ([1, 2, 3], SamplingParams.model_construct(**{**greedy(8).model_dump(), "temperature": 0.7, "seed": 2**64}), 500),
    ([1, 2, 3], SamplingParams.model_construct(**{**greedy(8).model_dump(), "temperature": float("nan")}), 400),
    ([1, CFG.vocab_size + 5, 3], greedy(8), 500),
], ids=["seed-2**64", "nan-temperature", "id-outside-vocab"])
def test_one_bad_request_fails_alone_and_frees_its_kv(solo, bad_ids, bad_params, status):
    jobs = [(GOOD[0][0], greedy(GOOD[0][1])), (bad_ids, bad_params), (GOOD[1][0], greedy(GOOD[1][1]))]
    last, sched = run(jobs)
    bad = last[1]["finish_reason"]
    assert bad["type"] == "abort" and bad["status_code"] == status and "request failed in the worker" in bad["message"], bad
    assert [last[0]["output_ids"], last[2]["output_ids"]] == solo  # the others: token-identical to solo runs
    assert all(last[i]["finish_reason"]["type"] == "length" for i in (0, 2))
    assert len(sched.alloc.free) == NUM_BLOCKS and not sched.running and not sched.waiting  # no KV leak
