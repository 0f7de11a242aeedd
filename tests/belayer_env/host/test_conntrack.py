"""The conntrack table set-up sizes (``belayer_env.host.conntrack``): lowered, never raised, kept
across reboots, a clear error for a bad knob; on the real kernel table (restored after)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_env.host import conntrack

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(conntrack.buckets() is None or os.geteuid() != 0,
                                reason="needs root and a kernel with conntrack")


@pytest.fixture
def table():
    """The kernel's table, put back as found."""
    found = conntrack.buckets()
    yield
    conntrack.BUCKETS_PATH.write_text(f"{found}\n")
    assert conntrack.buckets() == found


def test_a_larger_table_is_lowered_and_kept_across_reboots(table, tmp_path):
    conntrack.BUCKETS_PATH.write_text("65536\n")
    sysctl = tmp_path / "sysctl.d" / "60-belayer-conntrack.conf"
    said = conntrack.tune(16384, sysctl)
    assert conntrack.buckets() == 16384
    assert "lowered to 16384" in said and str(sysctl) in said
    assert "net.netfilter.nf_conntrack_buckets = 16384\n" in sysctl.read_text()
    assert conntrack.walk_s() > 0  # the walk CRIU does works from here


def test_a_smaller_table_is_never_raised_and_keep_keeps(table, tmp_path):
    conntrack.BUCKETS_PATH.write_text("4096\n")
    sysctl = tmp_path / "60-belayer-conntrack.conf"
    assert conntrack.tune(16384, sysctl) == "conntrack buckets 4096"
    assert conntrack.buckets() == 4096 and not sysctl.exists()  # nothing of ours to keep
    conntrack.BUCKETS_PATH.write_text("65536\n")
    assert "kept at 65536" in conntrack.tune(None, sysctl) and conntrack.buckets() == 65536


def test_the_knob_takes_keep_or_a_bucket_count():
    assert conntrack.wanted("") == conntrack.TARGET_BUCKETS
    assert conntrack.wanted("keep") is None and conntrack.wanted("8192") == 8192
    for bad in ("lots", "12", "-1", str(1 << 30)):
        with pytest.raises(ValueError, match=conntrack.ENV):
            conntrack.wanted(bad)


def test_setup_step_refuses_a_bad_knob_with_exit_2(table):
    found = conntrack.buckets()
    proc = subprocess.run([sys.executable, str(ROOT / "belayer_env" / "host" / "conntrack.py")], capture_output=True,
                          text=True, timeout=60, env={**os.environ, conntrack.ENV: "lots"})
    assert proc.returncode == 2 and conntrack.ENV in proc.stderr and conntrack.buckets() == found
    proc = subprocess.run([sys.executable, str(ROOT / "belayer_env" / "host" / "conntrack.py")], capture_output=True,
                          text=True, timeout=60, env={**os.environ, conntrack.ENV: "keep"})
    assert proc.returncode == 0 and f"kept at {found}" in proc.stdout
