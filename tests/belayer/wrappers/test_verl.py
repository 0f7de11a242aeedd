"""verl 0.9.1's own agent-loop path over Belayer (issue 49, items 1 and 4).

verl lives in its own venv (``scripts/setup_verl.sh``, part of ``scripts/setup.sh``; a
missing venv fails here with that hint, never skips). ``verl_driver.py`` runs in it: verl's
``AgentLoopWorker.generate_sequences`` on a ``DataProto`` batch (the code each of verl's
agent-loop worker actors runs: the loop registry from an ``agent_loop_config_path`` file, hydra
instantiation of ``BelayerSandboxAgentLoop``, verl's Continuous Token builder, padding and
``_postprocess`` into the batch verl trains on), with Belayer's ``EngineClient`` as its LLM
client. Not run here: verl's ``AgentLoopManager`` (Ray actors placed per node) and its
SGLang replicas (GPU); the call those replicas answer, ``generate(request_id, prompt_ids=...,
sampling_params=...)``, is the one ``EngineClient`` answers, and the driver makes it as the
worker does.

The engine is the embedded HF-layout model on the reference CPU worker with a shadow; the
rollout is greedy (top-k 1), so a batch with faults must equal the fault-free batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from belayer_engine import RecoverableEngine
from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
from tests.belayer.wrappers.episodes import (
    EPISODE,
    UNRECOVERABLE,
    first_sandbox_only,
    model_spans,
    read_json_line,
)
from tests.belayer_engine.conftest import poll

pytestmark = pytest.mark.timeout(900)

DEFAULT_VENV = "/opt/belayer/verl-venv"
SETUP_HINT = "run `bash scripts/setup_verl.sh` (part of scripts/setup.sh; or set BELAYER_VERL_VENV to its venv)"
DRIVER = Path(__file__).with_name("verl_driver.py")
ROOT = Path(__file__).resolve().parents[3]
TOL = 1e-4


def verl_python() -> str:
    python = Path(os.environ.get("BELAYER_VERL_VENV") or DEFAULT_VENV) / "bin" / "python"
    if not python.is_file():
        pytest.fail(f"verl's venv python {python} is missing: {SETUP_HINT}")
    return str(python)


class Driver:
    def __init__(self, python: str, url: str, model_dir: str):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        self.proc = subprocess.Popen([python, str(DRIVER), url, model_dir], cwd=ROOT, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.read()["phase"] == "ready"

    def send(self, phase: str, rows: int, episode: dict, kill_container: dict | None = None) -> None:
        self.proc.stdin.write(json.dumps({"phase": phase, "rows": rows, "episode": episode,
                                          "kill_container": kill_container}) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict:
        return read_json_line(self.proc, "verl")  # verl prints progress lines of its own on stdout

    def run(self, phase: str, rows: int, episode: dict, **kw) -> dict:
        self.send(phase, rows, episode, **kw)
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def setup(docker_client):
    python = verl_python()
    model_dir = str(ensure_embedded_model())
    with RecoverableEngine.launch(model=model_dir, workers=1, shadow=True) as engine:
        engine.wait_ready(timeout=180, stable=True)
        driver = Driver(python, engine.base_url, model_dir)
        try:
            want = driver.run("fault_free", 4, EPISODE)
            assert want["error"] is None, want.get("traceback")
            yield engine, driver, want
        finally:
            driver.close()


def assert_rows_equal(got: dict, want: dict) -> None:
    assert got["response_ids"] == want["response_ids"] and got["mask"] == want["mask"]
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert worst <= TOL, worst
    assert got["reward"] == want["reward"]


def assert_what_verl_received_is_what_the_engine_generated(row: dict, calls: list[dict]) -> None:
    """Each model turn of the row (mask 1) is one engine generation, ids and logprobs, in order;
    generations whose turn a rollback cut are the only ones missing."""
    turns = [(row["response_ids"][b:e], row["logprobs"][b:e]) for b, e in model_spans(row["mask"])]
    it = iter(calls)
    for ids, logprobs in turns:
        call = next((c for c in it if c["ids"] == ids), None)
        assert call is not None, f"a turn verl received is no generation of the engine: {ids}"
        assert max(abs(a - b) for a, b in zip(logprobs, call["logprobs"], strict=True)) <= TOL
    assert turns[-1][0] == calls[-1]["ids"]
    assert len(calls) - len(turns) >= len(row["belayer"]["rollbacks"])  # a rollback cut >= 1 turn


def test_a_batch_survives_a_worker_sigkill_and_a_container_kill(setup):
    engine, driver, want = setup
    model_dir = ensure_embedded_model()
    from safetensors.torch import load_file

    norm = {"model.norm.weight": load_file(str(model_dir / "model.safetensors"))["model.norm.weight"]}
    version = engine.update_weights(norm)  # the same values under a new version: same greedy ids
    native, killed = engine.router.native, {}

    def kill_worker() -> None:
        try:
            poll(lambda: any(len(r.gen.generated) >= 4 for r in list(native.running.values())), 300,
                 "a generation of the batch to reach 4 tokens", interval=0.002)
            killed["pid"] = engine.worker_pid(0)
            os.killpg(killed["pid"], signal.SIGKILL)
        except BaseException as e:  # noqa: BLE001 - reported below
            killed["error"] = e

    t = threading.Thread(target=kill_worker, daemon=True)
    t.start()
    got = driver.run("faulted", 4, EPISODE, kill_container={"sample": 1, "at_call": 2})
    t.join(60)
    assert got["error"] is None, got.get("traceback")
    assert "error" not in killed and killed.get("pid"), killed
    assert got["killed_containers"] == [1]
    handovers = [e for e in engine.events() if e["event"] == "handover"]
    assert handovers and handovers[-1]["path"] == "shadow", handovers

    rows = got["rows"]
    assert len(rows) == 4, "every sample of the batch returned"
    for i, (row, ref) in enumerate(zip(rows, want["rows"], strict=True)):
        assert_rows_equal(row, ref)
        assert_what_verl_received_is_what_the_engine_generated(row, got["calls"][str(i)])
        assert row["min_global_steps"] == row["max_global_steps"] == version, "one weight version per sample"
        assert {c["version"] for c in got["calls"][str(i)]} == {version}
    container = rows[1]["belayer"]
    assert len(container["rollbacks"]) == 1 and container["rollbacks"][0]["to_step"] <= 1, container
    assert container["recovered"] is True and container["fresh_sandbox_retries"] == 0
    assert sum(r["belayer"]["worker_recoveries"] for r in rows) >= 1, "a generation continued on the shadow"
    poll(lambda: engine.worker_pid(0) not in (None, killed["pid"]), 120, "the shadow to serve slot 0")


def test_a_sample_beyond_recovery_is_retried_in_a_fresh_sandbox(setup):
    """The faults of ``UNRECOVERABLE`` in each sample's first sandbox only (``episodes: 1``):
    the env gives up, ``PolicyEnv`` starts a fresh sandbox, the loop regenerates from the
    prompt, and verl receives the fault-free sample, labelled."""
    _, driver, want = setup
    got = driver.run("retried", 2, first_sandbox_only({**EPISODE, **UNRECOVERABLE}))
    assert got["error"] is None, got.get("traceback")
    for row, ref in zip(got["rows"], want["rows"][:2], strict=True):
        assert_rows_equal(row, ref)
        label = row["belayer"]
        assert label["fresh_sandbox_retries"] == 1, label
        assert label["retried_after"][0]["error"] in ("RestoreFailed", "SandboxLost", "InjectedFault"), label
        assert label["rollbacks"][-1]["fresh_sandbox"] == 1 and label["rollbacks"][-1]["to_step"] == 0


def test_past_its_retries_a_sample_is_dropped_never_scored_zero(setup):
    """The same faults in every sandbox, one retry allowed: the loop raises ``SampleDropped``
    out of verl's worker (no row at all, so no reward of 0; verl's ``trainer.v1``
    (``AgentLoopWorkerTQ._run_prompt``) marks the prompt's group failed and its replay buffer
    evicts it, counted as ``rollout_failure/evicted_samples``)."""
    _, driver, _ = setup
    episode = {**EPISODE, **UNRECOVERABLE, "infra": {"retries": 1}}
    got = driver.run("dropped", 2, episode)
    assert got["rows"] is None
    assert got["error"].startswith("SampleDropped: sample dropped after 2 unrecoverable"), got["error"]
