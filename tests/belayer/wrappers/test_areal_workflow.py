"""AReaL's ``RolloutWorkflow`` over Belayer (``belayer.wrappers.areal.SandboxWorkflow``, issue 49 item 4).

A driver in AReaL 1.0.4's venv (``scripts/setup_areal.sh``; missing: fails with the hint) runs
the workflow's ``arun_episode`` with AReaL's own ``RemoteSGLangEngine`` against the engine's
router, for one prompt's group of 2 greedy episodes in real sandboxes: fault-free; with each
first sandbox put beyond the env's recovery (retried in a fresh sandbox: AReaL gets the
fault-free trajectories); and with every sandbox beyond recovery (the group is rejected:
``None``, AReaL's "not used for training", never a zero reward).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from belayer_engine import RecoverableEngine
from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
from tests.belayer.wrappers.episodes import (
    EPISODE,
    UNRECOVERABLE,
    first_sandbox_only,
    read_json_line,
)
from tests.belayer.wrappers.test_areal import areal_python

pytestmark = pytest.mark.timeout(900)
TOL = 1e-4

DRIVER = r'''
import asyncio, json, sys
from transformers import AutoTokenizer
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.engine.sglang_remote import RemoteSGLangEngine
from belayer.wrappers.areal import SandboxWorkflow

addr, model_dir = sys.argv[1], sys.argv[2]
engine = RemoteSGLangEngine(InferenceEngineConfig(experiment_name="belayer", trial_name="areal-workflow",
                                                  setup_timeout=120, request_timeout=600))
engine.initialize(addr=[addr], train_data_parallel_size=1)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
data = {"messages": [{"role": "user", "content": "List the files in /tmp, then submit."}],
        "setup": "mkdir -p /tmp/work", "max_turns": 3}
print(json.dumps({"phase": "ready"}), flush=True)
for line in sys.stdin:
    workflow = SandboxWorkflow(GenerationHyperparameters(max_new_tokens=24, greedy=True), tokenizer,
                               episode=json.loads(line), group_size=2)
    out = asyncio.run(workflow.arun_episode(engine, dict(data)))
    print(json.dumps({"result": None if out is None else {k: v.tolist() for k, v in out.items()},
                      "labels": workflow.labels}), flush=True)
engine.destroy()
'''


@pytest.fixture(scope="module")
def areal(docker_client):
    python = areal_python()
    model_dir = str(ensure_embedded_model())
    with RecoverableEngine.launch(model=model_dir, workers=1, shadow=True) as engine:
        engine.wait_ready(timeout=180, stable=True)
        addr = engine.base_url.removesuffix("/v1").removeprefix("http://")
        proc = subprocess.Popen([python, "-c", DRIVER, addr, model_dir], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def run(episode: dict) -> dict:
            proc.stdin.write(json.dumps(episode) + "\n")
            proc.stdin.flush()
            return read()

        def read() -> dict:
            return read_json_line(proc, "AReaL")

        try:
            assert read()["phase"] == "ready"
            want = run(EPISODE)
            yield run, want
        finally:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_a_group_of_sandbox_episodes_is_an_areal_trajectory_batch(areal):
    _, want = areal
    out = want["result"]
    assert len(out["input_ids"]) == 2 and out["input_ids"][0] == out["input_ids"][1]  # greedy: the same twice
    row, mask = out["input_ids"][0], out["loss_mask"][0]
    assert sum(mask) == 3 * 24, "three model turns of 24 tokens, trained"
    assert all(v == 0 for v, m in zip(out["versions"][0], mask, strict=True) if m)  # one weight version
    assert all(v == -1 for v, m, a in zip(out["versions"][0], mask, out["attention_mask"][0], strict=True) if a and not m)
    assert len(row) == len(mask) and out["rewards"] == [0.0, 0.0]  # truncated at max_turns: the episode's outcome
    assert [lb["fresh_sandbox_retries"] for lb in want["labels"]] == [0, 0]


def test_beyond_recovery_each_episode_is_retried_in_a_fresh_sandbox(areal):
    run, want = areal
    got = run(first_sandbox_only({**EPISODE, **UNRECOVERABLE}))
    assert got["result"] is not None
    for key in ("input_ids", "loss_mask", "versions", "rewards", "attention_mask"):
        assert got["result"][key] == want["result"][key], key
    worst = max(abs(a - b) for ra, rb in zip(got["result"]["logprobs"], want["result"]["logprobs"], strict=True)
                for a, b in zip(ra, rb, strict=True))
    assert worst <= TOL, worst
    for label in got["labels"]:
        assert label["fresh_sandbox_retries"] == 1 and label["rollbacks"][-1]["fresh_sandbox"] == 1, label


def test_past_its_retries_the_group_is_rejected_never_scored_zero(areal):
    run, _ = areal
    got = run({**EPISODE, **UNRECOVERABLE, "infra": {"retries": 0}})
    assert got["result"] is None, "AReaL's rejected trajectory: no row, no reward"
    assert all(label["dropped"] for label in got["labels"]), got["labels"]
