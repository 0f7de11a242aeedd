"""TRL's own GRPOTrainer, end to end, with faults on both sides (examples/trl_grpo/).

A short run of the example's command, exactly as a user runs it (TRL's venv python, the
module's CLI, its ``--json`` summary): TRL 1.16 trains the embedded model for 2 GRPO steps
on CPU, its ``rollout_func`` rolling out multi-turn episodes in real containers against a
real ``RecoverableEngine``, while a container is SIGKILLed and the serving worker is
SIGKILLed mid-generation at every step, and one more container is SIGKILLed with every restore of
its sandbox failing (the infrastructure policy restarts that episode in a fresh sandbox). TRL comes from its own venv
(``scripts/setup_trl.sh``, part of ``scripts/setup.sh``): a missing venv fails, never skips.
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trl_grpo_survives_container_and_worker_kills(docker_client):
    python = trl_python()
    argv = [python, "-m", "belayer.examples.trl_grpo", "--json", "--steps", str(STEPS),
            "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP), "--sft-steps", "4",
            "--container-kills-per-step", "1", "--worker-kills-per-step", "1", "--beyond-recovery-per-step", "1",
            "--parallel", "4"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=840)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        _reap_containers_of(proc.pid)
        pytest.fail(f"the run did not finish in 840 s; its progress:\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{err[-4000:]}\n{out[-2000:]}"
    summary = json.loads(out.strip().splitlines()[-1])

    # TRL trained and logged as usual: a loss and a reward per step
    assert summary["steps"] == STEPS
    assert [row["step"] for row in summary["trl_log"]] == list(range(1, STEPS + 1))
    for row in summary["trl_log"]:
        assert isinstance(row["loss"], float) and math.isfinite(row["loss"]), row
        assert isinstance(row["reward"], float) and 0.0 <= row["reward"] <= 1.0, row

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

    # weights synced after every step; each step's samples come from exactly the version
    # pushed before it, and no sample mixes versions
    pushes = summary["weight_pushes"]
    assert [p["step"] for p in pushes] == list(range(1, STEPS + 1))
    versions = [p["version"] for p in pushes]
    assert versions == sorted(set(versions)) and summary["engine_weight_version"] == versions[-1]
    served_first = versions[0] - 1  # the warm start's push, before step 1
    assert summary["sample_versions_by_step"] == {
        str(k + 1): [v] for k, v in enumerate([served_first, *versions[:-1]])}
    assert summary["samples_mixed_versions"] == 0
