"""The checkpoint benchmarks (capture, restore, standby, fork: one script per question) run
again and again on one machine and leave nothing behind.

Real Docker + CRIU: two back-to-back runs of each must both succeed (an earlier version
crashed at its second run: "content sha256:... already exists" from containerd), each
writes its JSON with every method of its question and a plot beside it, and none may leave
a container, a Docker image, a checkpoint store, a containerd copy or a shared layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "capture_bench": {"belayer", "paused", "docker"},
    "restore_bench": {"belayer", "prestaged", "prestaged_lost", "prestaged_spare", "prestaged_copied", "docker", "cold"},
    "standby_bench": {"standby"},
    "fork_bench": {"fork", "fork_copied", "fork_pooled", "fork_ahead", "fork_warm", "belayer"},
}
"""Each script's methods (besides the breakdowns: floors, phases, the env's own rollback)."""
PARTS = {"belayer_detail", "floors", "standby_phases", "env_standby", "raw"}


def check_question(name: str, result: dict) -> None:
    idle = result["scenarios"]["idle"]
    assert set(idle) - PARTS == EXPECTED[name]
    targets = {(t["method"], t["scenario"]) for t in result["targets"]}
    if name == "capture_bench":
        assert idle["belayer_detail"], "the incremental capture's breakdown is reported"
        assert {"freeze_thaw_s", "criu_frozen_s", "criu_memdump_s"} <= set(idle["floors"])
        assert idle["belayer"]["frozen_s"]["n"] == 1 and "idle" in result["soft_dirty_estimate"]
    elif name == "restore_bench":
        assert all(idle[m]["restore_s"]["n"] == 1 for m in EXPECTED[name])
    elif name == "standby_bench":
        assert {"fence_s", "thaw_s", "verify_s", "names_s"} <= set(idle["standby_phases"]), "the rollback's phases"
        assert idle["env_standby"]["recovery_s"]["n"] == 1, "the env's own rollback onto its standby"
        assert idle["standby"]["restore_s"]["n"] == 1
        assert {"freeze_thaw_s", "docker_list_s"} <= set(idle["floors"])
        assert targets >= {("standby", "idle"), ("env_standby", "idle")}
    else:
        assert result["fork_n"] == 2 and idle["fork"]["restore_s"]["n"] == 1 and "start_n_s" in idle["floors"]
        assert targets >= {("fork_warm", "idle"), ("fork_ahead", "idle")}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_benchmark_is_repeatable_and_cleans_up(name, tmp_path, docker_client):
    from belayer_env.criu import runtime
    from belayer_env.restore import ctrd_copies, prestaging
    from belayer_env.store import shared_layer

    if why := runtime.available():
        pytest.skip(f"CRIU checkpoints unavailable: {why}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    extra = ["--fork-n", "2"] if name == "fork_bench" else []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--runs", "1",
                               "--scenarios", "idle", *extra, "--out", str(out)],
                              capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        result = json.loads(out.read_text())
        check_question(name, result)
        run_id = result["host"]["run_id"]
        assert result["host"]["uptime_start"] and result["host"]["uptime_end"]
        assert out.with_suffix(".png").stat().st_size > 0, "the run's plot is written beside its JSON"
        assert result["source"]["command"].startswith(f"python3 benchmarks/{name}.py --runs 1"), result["source"]
        assert not docker_client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"})
        assert not docker_client.api.images(name=f"belayer-bench:{run_id}-*")
        assert not Path(result["host"]["store"]).exists()
        owner = result["host"]["owner"]  # containerd's copies of its restores (it never removes them)
        assert not [d for d, nonce in ctrd_copies.copies() if nonce.endswith(f"~{owner}")]
        lowers = shared_layer.lowers_root(prestaging.docker_root(docker_client))
        assert not [p for p in (lowers.iterdir() if lowers.is_dir() else ())
                    if run_id in p.name or p.name.endswith(f"~{owner}")]  # fork's shared layers, the pool's aliases
