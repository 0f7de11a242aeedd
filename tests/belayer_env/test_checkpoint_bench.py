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
        assert {m for m in idle if m not in ("raw", "belayer_detail")} == {
            "belayer", "paused", "prestaged", "prestaged_lost", "prestaged_spare", "prestaged_copied", "standby",
            "fork", "fork_copied", "fork_pooled", "fork_ahead", "docker", "cold"}
        assert idle["belayer_detail"], "the incremental capture's breakdown is reported"
        assert out.with_suffix(".png").stat().st_size > 0, "the run's plot is written beside its JSON"
        assert idle["fork"]["restore_s"]["n"] == 1 and idle["standby"]["restore_s"]["n"] == 1
        assert not docker_client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"})
        assert not docker_client.api.images(name=f"belayer-bench:{run_id}-*")
        assert not Path(result["host"]["store"]).exists()
        owner = result["host"]["owner"]  # containerd's copies of its restores (it never removes them)
        assert not [d for d, nonce in ctrd_copies.copies() if nonce.endswith(f"~{owner}")]
        lowers = shared_layer.lowers_root(prestaging.docker_root(docker_client))
        assert not [p for p in (lowers.iterdir() if lowers.is_dir() else ())
                    if run_id in p.name or p.name.endswith(f"~{owner}")]  # fork's shared layers, the pool's aliases


def test_restore_ab_compares_both_extractions_and_puts_the_switch_back(tmp_path, docker_client):
    from belayer_env.criu import runtime
    from belayer_env.host import fast_tar

    if why := runtime.available():
        pytest.skip(f"CRIU checkpoints unavailable: {why}")
    off_before = fast_tar.RESTORE_OFF.exists()
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "restore_ab.py"), "--knob", "tmpfs-tar", "--runs", "2",
                           "--scenarios", "idle", "--fork-n", "2", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    idle = json.loads(out.read_text())["scenarios"]["idle"]
    for variant in ("default", "tuned"):
        assert idle[variant]["restore_s"]["n"] == 2 and idle[variant]["fork_s"]["n"] == 2
    # the last round's restore logs: the helper filled every tmpfs of the tuned restore, none of the other
    assert idle["raw"]["tuned"]["tmpfs_in_process"] >= 4 and idle["raw"]["default"]["tmpfs_in_process"] == 0
    assert fast_tar.RESTORE_OFF.exists() == off_before
    run_id = json.loads(out.read_text())["host"]["run_id"]
    assert not docker_client.api.containers(all=True, filters={"name": f"belayer-bench-{run_id}"})


def test_scratch_ab_measures_both_scratch_kinds_and_cleans_up(tmp_path, docker_client):
    from belayer_env.criu import runtime
    from belayer_env.store import in_memory

    if why := runtime.available():
        pytest.skip(f"CRIU checkpoints unavailable: {why}")
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scratch_ab.py"), "--runs", "1",
                           "--scenarios", "idle", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    idle = result["scenarios"]["idle"]
    assert idle["plain"]["frozen_s"]["n"] == 1 and idle["large"]["frozen_s"]["n"] == 1
    assert idle["plain"]["criu_memdump_s"]["p50"] > 0 and idle["large"]["criu_memdump_s"]["p50"] > 0
    if in_memory.huge_supported() and os.geteuid() == 0:
        assert "huge=within_size" in result["scratch"]["large"], result["scratch"]
    assert not Path(result["scratch"]["plain"]).exists(), "the plain scratch was left behind"
    assert not docker_client.api.containers(all=True, filters={"name": f"belayer-bench-{result['host']['run_id']}"})


def test_frozen_ab_measures_both_table_sizes_and_puts_the_table_back(tmp_path, docker_client):
    from belayer_env.criu import runtime
    from belayer_env.host import conntrack

    if why := runtime.available():
        pytest.skip(f"CRIU checkpoints unavailable: {why}")
    if conntrack.buckets() is None or os.geteuid() != 0:
        pytest.skip("needs root and a kernel with conntrack")
    found = conntrack.buckets()
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "frozen_ab.py"), "--knob", "conntrack",
                           "--runs", "1", "--scenarios", "idle", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    idle = result["scenarios"]["idle"]
    assert idle["default"]["frozen_s"]["n"] == 1 and idle["tuned"]["frozen_s"]["n"] == 1
    assert set(result["knob_detail"]["walk_ms_p50"]) == {"default", "tuned"} and out.with_suffix(".png").exists()
    assert conntrack.buckets() == found, "the benchmark did not put the table back"
    assert not docker_client.api.containers(all=True, filters={"name": f"belayer-bench-{result['host']['run_id']}"})
