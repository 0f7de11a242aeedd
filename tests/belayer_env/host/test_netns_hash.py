"""Socket tables of their own for new network namespaces (``belayer_env.host.netns_hash``):
set where shared, a chosen size kept, kept across reboots, a clear error for a bad knob; on
the real kernel settings (restored after), and seen from inside a real sandbox."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_env.host import netns_hash

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not netns_hash.sizes() or os.geteuid() != 0,
                                reason="needs root and a kernel with per-namespace socket tables")


@pytest.fixture
def settings():
    """The kernel's settings, put back as found."""
    found = netns_hash.sizes()
    yield
    for proto, value in found.items():
        netns_hash.SETTINGS[proto].write_text(f"{value}\n")
    assert netns_hash.sizes() == found


def _own_tables() -> dict[str, str]:
    """What a namespace created now says of its tables (negative: shares the host's)."""
    out = subprocess.run(["unshare", "--net", "cat", "/proc/sys/net/ipv4/tcp_ehash_entries",
                          "/proc/sys/net/ipv4/udp_hash_entries"], capture_output=True, text=True, check=True).stdout
    return dict(zip(("tcp", "udp"), out.split(), strict=True))


def test_shared_tables_are_replaced_and_kept_across_reboots(settings, tmp_path):
    for path in netns_hash.SETTINGS.values():
        path.write_text("0\n")
    assert all(int(v) < 0 for v in _own_tables().values())  # shared: the host's
    sysctl = tmp_path / "sysctl.d" / "60-belayer-netns-hash.conf"
    said = netns_hash.tune(1024, sysctl)
    assert netns_hash.sizes() == {"tcp": 1024, "udp": 1024} and netns_hash.ok()
    assert "set now" in said and str(sysctl) in said
    assert "net.ipv4.tcp_child_ehash_entries = 1024\n" in sysctl.read_text()
    assert _own_tables() == {"tcp": "1024", "udp": "1024"}


def test_a_chosen_size_is_kept_and_keep_keeps(settings, tmp_path):
    for path in netns_hash.SETTINGS.values():
        path.write_text("4096\n")
    sysctl = tmp_path / "60-belayer-netns-hash.conf"
    assert "TCP 4096, UDP 4096" in netns_hash.tune(1024, sysctl)
    assert netns_hash.sizes() == {"tcp": 4096, "udp": 4096} and not sysctl.exists()  # nothing of ours to keep
    for path in netns_hash.SETTINGS.values():
        path.write_text("0\n")
    assert "keep" in netns_hash.tune(None, sysctl) and not netns_hash.ok()


def test_the_knob_takes_keep_or_a_power_of_two():
    assert netns_hash.wanted("") == netns_hash.TARGET_ENTRIES
    assert netns_hash.wanted("keep") is None and netns_hash.wanted("256") == 256
    for bad in ("lots", "100", "64", "1000", str(1 << 17), "-1"):
        with pytest.raises(ValueError, match=netns_hash.ENV):
            netns_hash.wanted(bad)


def test_setup_step_refuses_a_bad_knob_with_exit_2(settings):
    found = netns_hash.sizes()
    script = ROOT / "belayer_env" / "host" / "netns_hash.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, netns_hash.ENV: "lots"})
    assert proc.returncode == 2 and netns_hash.ENV in proc.stderr and netns_hash.sizes() == found


def test_a_sandbox_created_after_setup_has_tables_of_its_own(make_sandbox):
    """What CRIU walks inside the freeze is the sandbox namespace's own small table."""
    if not netns_hash.ok():
        pytest.skip("set-up has not run here (bash scripts/setup.sh)")
    sb = make_sandbox()
    out = sb.execute("cat /proc/sys/net/ipv4/tcp_ehash_entries /proc/sys/net/ipv4/udp_hash_entries")["output"]
    assert [int(v) for v in out.split()] == [netns_hash.sizes()["tcp"], netns_hash.sizes()["udp"]]
