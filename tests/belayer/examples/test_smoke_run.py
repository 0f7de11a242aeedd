"""A short end-to-end run with faults on every side: real engine processes, real
containers, a learner process that is SIGKILLed and resumes. The run must complete with
every injected fault accounted for."""

from __future__ import annotations

import json

import pytest

from belayer.examples.swe_rl.config import FaultConfig, RunConfig
from belayer.examples.swe_rl.run import run


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_short_run_survives_env_worker_and_learner_faults(tmp_path, docker_client):
    cfg = RunConfig(out_dir=str(tmp_path / "run"), steps=2, n_tasks=4, tasks_per_step=2, group_size=2,
                    parallel=4, seed=1,
                    # one torch thread: on a machine busier than its cores, OpenMP threads that
                    # spin-wait for each other made the warm start ~8x slower (10 s vs 1.2 s/iter)
                    threads=1,
                    faults=FaultConfig(env_rate=0.25, worker_rate_per_min=60, worker_min_gap_s=14,
                                       worker_first_kill_s=1.0, learner_kill_steps=[1]))
    lines: list[str] = []
    summary = run(cfg, display=lines.append)

    assert summary["steps"] == 2
    assert summary["learner_resumes"] == 1
    assert summary["learner"][0]["resumed_from_step"] in (0, 1)
    assert summary["worker_faults"] >= 1
    assert summary["worker_recoveries"] == summary["worker_faults"]
    assert summary["unrecovered_dropped"] == 0 and summary["stale_dropped"] == 0
    assert summary["env_recoveries"] <= summary["env_faults"]
    assert summary["reward_first"] is not None and summary["reward_last"] is not None
    for key in ("env_faults", "worker_faults", "infra_labelled", "seconds", "reward_first", "reward_last"):
        assert key in summary
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed and resumed[0]["checkpoint"].startswith("step-")
    assert (tmp_path / "run" / "summary.json").is_file()
    assert any("learner SIGKILLed" in line for line in lines)
