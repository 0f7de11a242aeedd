"""The checkpoint benchmark runs again and again on one machine and leaves nothing behind.

Real Docker + CRIU: two back-to-back runs (every method, fork included) must both succeed
(an earlier version crashed at its second run: "content sha256:... already exists" from
containerd), and neither may leave a container, a Docker image or a checkpoint store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_is_repeatable_and_cleans_up(tmp_path, docker_client):
    from belayer_env.criu import runtime
    from belayer_env.restore import ctrd_copies, prestaging
    from belayer_env.store import shared_layer

    if why := runtime.available():
        pytest.skip(f"CRIU checkpoints unavailable: {why}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkpoint_bench.py"), "--runs", "1",
                               "--scenarios", "idle", "--fork-n", "2", "--out", str(out)],
                              capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        result = json.loads(out.read_text())
        run_id = result["host"]["run_id"]
        idle = result["scenarios"]["idle"]
        assert {m for m in idle if m not in ("raw", "belayer_detail", "standby_phases", "floors", "env_standby")} == {
            "belayer", "paused", "prestaged", "prestaged_lost", "prestaged_spare", "prestaged_copied", "standby",
            "fork", "fork_copied", "fork_pooled", "fork_ahead", "fork_warm", "docker", "cold"}
        assert idle["belayer_detail"], "the incremental capture's breakdown is reported"
        assert {"fence_s", "thaw_s", "verify_s", "names_s"} <= set(idle["standby_phases"]), "the rollback's phases"
        assert idle["env_standby"]["recovery_s"]["n"] == 1, "the env's own rollback onto its standby"
        assert {"freeze_thaw_s", "criu_frozen_s", "criu_memdump_s", "docker_list_s", "start_n_s"} <= set(idle["floors"])
        assert {(t["method"], t["scenario"]) for t in result["targets"]} >= {("standby", "idle"), ("fork_warm", "idle")}
        assert result["host"]["uptime_start"] and result["host"]["uptime_end"]
        assert out.with_suffix(".png").stat().st_size > 0, "the run's plot is written beside its JSON"
        assert result["source"]["command"].startswith("python3 benchmarks/checkpoint_bench.py --runs 1"), result["source"]
        assert idle["fork"]["restore_s"]["n"] == 1 and idle["standby"]["restore_s"]["n"] == 1
        assert not docker_client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"})
        assert not docker_client.api.images(name=f"belayer-bench:{run_id}-*")
        assert not Path(result["host"]["store"]).exists()
        owner = result["host"]["owner"]  # containerd's copies of its restores (it never removes them)
        assert not [d for d, nonce in ctrd_copies.copies() if nonce.endswith(f"~{owner}")]
        lowers = shared_layer.lowers_root(prestaging.docker_root(docker_client))
        assert not [p for p in (lowers.iterdir() if lowers.is_dir() else ())
                    if run_id in p.name or p.name.endswith(f"~{owner}")]  # fork's shared layers, the pool's aliases

