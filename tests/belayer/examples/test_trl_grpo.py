"""TRL's own GRPOTrainer, end to end, with faults on both sides (examples/trl_grpo/).

A short run of the example's command, exactly as a user runs it (TRL's venv python, the
module's CLI, its ``--json`` summary): TRL 1.16 trains the embedded model for 2 GRPO steps
on CPU, its ``rollout_func`` rolling out multi-turn episodes in real containers against a
real ``RecoverableEngine``, while a container is SIGKILLed and the serving worker is
SIGKILLed mid-generation at every step, and one more container is SIGKILLed with every restore of
its sandbox failing (the infrastructure policy restarts that episode in a fresh sandbox). TRL comes from its own venv
(``scripts/setup_trl.sh``, part of ``scripts/setup.sh``): a missing venv fails, never skips.

The same example with ``--mode environment_factory``: TRL's own tool-calling loop over
``SandboxEnvironment`` (TRL parses the model's ``<tool_call>`` JSON and runs ``bash`` in the
sandbox), one step of one group with a container kill, a worker SIGKILL mid-generation and a
sandbox beyond recovery; then, with no retry left, the drop of that rollout with its group.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TRL_VENV_DEFAULT = "/opt/belayer/trl-venv"
HINT = "run `bash scripts/setup_trl.sh` (part of `bash scripts/setup.sh`; or set BELAYER_TRL_VENV to its venv)"
STEPS, PROMPTS, GROUP = 2, 2, 2


def trl_python() -> str:
    python = Path(os.environ.get("BELAYER_TRL_VENV") or TRL_VENV_DEFAULT) / "bin" / "python"
    if not python.is_file():
        pytest.fail(f"TRL's venv python {python} is missing: {HINT}")
    probe = subprocess.run([str(python), "-c", "import trl, transformers; print(trl.__version__)"],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        pytest.fail(f"TRL does not import in {python} ({probe.stderr.strip()[-300:]}): {HINT}")
    assert probe.stdout.strip().startswith("1.16."), probe.stdout
    return str(python)


def _reap_containers_of(pid: int) -> None:
    """The containers a run killed by the timeout left (labelled with its pid), and only those."""
    with contextlib.suppress(Exception):
        from belayer_env.ops.gc import list_managed, reap
        from belayer_env.sandbox.docker_api import connect

        client = connect()
        reap(client, [c for c in list_managed(client) if c.orphaned and c.owner.endswith(f":{pid}")])


def run_example(*args: str, expect_rc: int = 0) -> dict:
    """``python -m belayer.examples.trl_grpo --json ARGS`` in TRL's venv; its summary."""
    argv = [trl_python(), "-m", "belayer.examples.trl_grpo", "--json", *args]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=840)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        _reap_containers_of(proc.pid)
        pytest.fail(f"the run did not finish in 840 s; its progress:\n{err[-3000:]}")
    assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{err[-4000:]}\n{out[-2000:]}"
    return json.loads(out.strip().splitlines()[-1])


def assert_one_version_per_step(summary: dict, steps: int) -> None:
    """Weights synced after every step; each step's samples come from exactly the version
    pushed before it, and no sample mixes versions."""
    pushes = summary["weight_pushes"]
    assert [p["step"] for p in pushes] == list(range(1, steps + 1))
    versions = [p["version"] for p in pushes]
    assert versions == sorted(set(versions)) and summary["engine_weight_version"] == versions[-1]
    served_first = versions[0] - 1  # the warm start's push, before step 1
    assert summary["sample_versions_by_step"] == {
        str(k + 1): [v] for k, v in enumerate([served_first, *versions[:-1]])}
    assert summary["samples_mixed_versions"] == 0


def assert_trl_logged(summary: dict, steps: int) -> None:
    """TRL trained and logged as usual: a finite loss and a reward per step."""
    assert summary["steps"] == steps
    assert [row["step"] for row in summary["trl_log"]] == list(range(1, steps + 1))
    for row in summary["trl_log"]:
        assert isinstance(row["loss"], float) and math.isfinite(row["loss"]), row
        assert isinstance(row["reward"], float) and 0.0 <= row["reward"] <= 1.0, row


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trl_grpo_survives_container_and_worker_kills(docker_client):
    summary = run_example("--steps", str(STEPS), "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP),
                          "--sft-steps", "4", "--container-kills-per-step", "1", "--worker-kills-per-step", "1",
                          "--beyond-recovery-per-step", "1", "--parallel", "4")

    assert_trl_logged(summary, STEPS)

    # faults on both sides, every one recovered, nothing lost
    injected, recovered = summary["faults_injected"], summary["faults_recovered"]
    assert injected["container_kill"] >= STEPS and injected["worker_sigkill"] >= 1, injected
    assert injected["beyond_recovery"] == STEPS and summary["fresh_sandbox_retries"] >= STEPS, summary
    assert recovered == injected and summary["all_faults_recovered"], summary
    assert summary["env_recoveries"] >= injected["container_kill"]
    assert summary["engine_handovers"] >= injected["worker_sigkill"]
    assert summary["generations_continued"] >= 1  # a generation in flight went on on the shadow
    assert summary["samples"] == STEPS * PROMPTS * GROUP
    assert summary["samples_lost"] == 0 and summary["samples_dropped_with_group"] == 0

    assert_one_version_per_step(summary, STEPS)


ENV_GROUP = 3  # rollout 0: container kill, 1: the step's worker kill, 2: beyond recovery (Rollouts.plan's order)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trl_environment_factory_survives_container_and_worker_kills(docker_client):
    """TRL's own tool-calling loop (``environment_factory``) over Belayer sandboxes, the engine generating."""
    summary = run_example("--mode", "environment_factory", "--steps", "1", "--group-size", str(ENV_GROUP),
                          "--temperature", "0.5", "--container-kills-per-step", "1", "--worker-kills-per-step", "1",
                          "--beyond-recovery-per-step", "1")
    assert_trl_logged(summary, 1)
    assert summary["sft_loss"][-1] < 0.05, "the warm start taught the tool-call JSON"
    # every rollout ran its calls through TRL's tool loop in its sandbox (the retried one twice over)
    assert summary["tool_calls"] >= ENV_GROUP + 1, summary

    # the container SIGKILLed while the model wrote call 2 was restored at boundary 1 (call 1's
    # file in it), the one beyond recovery rolled out again in a fresh sandbox, the worker
    # SIGKILLed mid-generation continued on the shadow: every fault happened and was recovered
    injected, recovered = summary["faults_injected"], summary["faults_recovered"]
    assert injected == {"container_kill": 2, "worker_sigkill": 1, "beyond_recovery": 1}, injected
    assert recovered == injected and summary["all_faults_recovered"], summary
    assert summary["env_restored_boundaries"] == {"0": 1, "1": 1}, summary
    assert summary["fresh_sandbox_retries"] == 1 and summary["turns_rolled_back"] == 0
    assert summary["killed_generations_continued"] == 1 and summary["engine_handovers"] >= 1

    # nothing lost: TRL trained on every rollout with a real reward read from its final sandbox
    assert summary["samples"] == ENV_GROUP and summary["samples_lost"] == 0
    assert summary["samples_dropped_with_group"] == 0
    [received] = summary["trl_received"]
    assert all(isinstance(r, float) for r in received["rewards"]) and all(n > 0 for n in received["loss_tokens"])
    assert_one_version_per_step(summary, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_environment_factory_drops_past_its_retries_with_its_group(docker_client):
    """With no retry left, the rollout whose sandbox is beyond recovery (killed while the model
    writes call 1) is dropped with its group: TRL gets reward None (unscorable: advantage 0) and
    no loss token for the whole group, never a reward of 0. The run exits 1 (a sample lost)."""
    summary = run_example("--mode", "environment_factory", "--steps", "1", "--group-size", "2", "--turns", "1",
                          "--sft-steps", "0", "--infra-retries", "0", "--container-kills-per-step", "0",
                          "--worker-kills-per-step", "0", "--beyond-recovery-per-step", "1", expect_rc=1)
    assert summary["faults_injected"]["beyond_recovery"] == 1 and summary["fresh_sandbox_retries"] == 1
    assert summary["samples_lost"] == 1 and summary["samples_dropped_with_group"] == 1
    assert summary["trl_received"] == [{"step": 1, "rewards": [None, None], "loss_tokens": [0, 0]}]
    [row] = summary["trl_log"]
    assert row["loss"] == 0.0 and row["reward"] is None, row  # nothing to learn from, nothing learned
    assert_one_version_per_step(summary, 1)
