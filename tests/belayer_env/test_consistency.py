"""The consistency harness: >= 30 trials with real fail-stops, zero counterexamples."""

from __future__ import annotations

import json

from belayer_env.consistency import run_consistency
from belayer_env.consistency.harness import _golden
from belayer_env.consistency.workload import ACTIONS, SETUP, exactly_once_violations, probe
from belayer_env.env.recoverable import RecoverableSandboxEnv

CI_TRIALS = 30
STANDBY_TRIALS = 12
JOBS = 2  # trials at once: faults also land while the host checkpoints or restores another sandbox


def test_thirty_faulty_trials_converge_to_the_golden_state():
    report = run_consistency(CI_TRIALS, seed=2024, jobs=JOBS)
    details = [(r.fault.model_dump(), r.problems, r.events) for r in report.counterexamples]
    assert report.passed == CI_TRIALS and not report.counterexamples, json.dumps(details, indent=1)[:6000]
    assert report.faults_fired >= CI_TRIALS * 0.9  # a trial whose fault never fired proves nothing
    assert set(report.by_where) == {"action", "checkpoint", "restore"}
    assert report.rollbacks >= CI_TRIALS * 0.6


def test_the_harness_detects_a_replayed_action(docker_client):
    """Negative control: an action applied twice must be caught (else 0 counterexamples means nothing)."""
    golden = _golden(2)
    env = RecoverableSandboxEnv(client=docker_client, checkpoint_policy="never")
    try:
        env.reset(options={"setup": SETUP})
        for i, action in enumerate(ACTIONS):
            env.step(action)
            if i == 1:
                env.step(action)  # what a replaying recovery would do (action 2 can run twice)
        state = probe(env.sandbox)
    finally:
        env.close()
    assert exactly_once_violations(state)
    assert state["tree"] != golden.state["tree"] and state["counter"] != golden.state["counter"]


def test_cli_json(capsys):
    from belayer.cli import main

    assert main(["consistency", "--trials", "1", "--seed", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trials"] == 1 and report["passed"] == 1 and report["counterexamples"] == []
    assert main(["consistency", "--trials", "1", "--jobs", "0"]) == 2  # a usage error, nothing run


def test_trials_with_the_standby_path_on_converge():
    """Standby on: faults also hit its preparation and its thaw; zero counterexamples."""
    report = run_consistency(STANDBY_TRIALS, seed=15, standby=True, jobs=JOBS)
    details = [(r.fault.model_dump(), r.problems, r.events) for r in report.counterexamples]
    assert report.passed == STANDBY_TRIALS and not report.counterexamples, json.dumps(details, indent=1)[:6000]
    assert report.by_where.get("standby", 0) >= 1
    assert report.faults_fired >= STANDBY_TRIALS * 0.9


def test_trials_with_restores_while_idle_converge():
    """``recover_while_idle`` on (and the standby): faults also kill the sandbox while the
    scripted agent thinks; a restore then runs in the background. Zero counterexamples."""
    report = run_consistency(STANDBY_TRIALS, seed=124, standby=True, idle=True, jobs=JOBS)
    details = [(r.fault.model_dump(), r.problems, r.events) for r in report.counterexamples]
    assert report.passed == STANDBY_TRIALS and not report.counterexamples, json.dumps(details, indent=1)[:6000]
    assert report.by_where.get("idle", 0) >= 3
    assert report.faults_fired >= STANDBY_TRIALS * 0.9
