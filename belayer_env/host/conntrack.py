"""The host's conntrack hash table: CRIU walks all of it, twice, inside every capture's freeze.

Why this matters: for a sandbox's network namespace CRIU dumps its conntrack entries with a
netlink dump (``dump_nf_ct`` in CRIU's ``net.c``), and then again for "expectations" (CRIU
4.2 sends the same ``CT_GET`` message). The kernel's conntrack table is one hash table for
all namespaces, and a dump visits every bucket whatever the namespace holds: with 262,144
buckets (the kernel's default on hosts with 4 GiB or more) one walk took 10.5-14 ms on the
2-core VM here, in an empty namespace as in the host's, so 21-28 ms of every frozen window;
with 16,384 buckets 0.7-0.8 ms. That was the whole "network namespace" step of a capture.

``tune()`` (``bash scripts/setup.sh``) lowers ``net.netfilter.nf_conntrack_buckets`` to
``TARGET_BUCKETS`` when it is larger, and keeps it so across reboots (``SYSCTL_FILE``);
never raises it. The price, host-wide: with as many tracked connections as
``nf_conntrack_max`` a lookup walks longer chains; a host whose own connections number in
the tens of thousands may keep its table (``BELAYER_CONNTRACK_BUCKETS=keep`` at set-up, or
a number). Sandboxes have no network by default and add no entries.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from pathlib import Path

if __package__:
    from belayer_env.host.loopback import write_if_changed
else:  # `python3 belayer_env/host/conntrack.py` (set-up): the sibling module, without the package
    from loopback import write_if_changed

BUCKETS_PATH = Path("/proc/sys/net/netfilter/nf_conntrack_buckets")
SYSCTL_FILE = Path("/etc/sysctl.d/60-belayer-conntrack.conf")
TARGET_BUCKETS = 16384
ENV = "BELAYER_CONNTRACK_BUCKETS"

_NETLINK_NETFILTER = 12
_CT_GET = (1 << 8) | 1  # NFNL_SUBSYS_CTNETLINK, IPCTNL_MSG_CT_GET: what CRIU sends, twice
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3


def buckets() -> int | None:
    """The table's bucket count; None where the kernel has no conntrack (nothing to walk)."""
    try:
        return int(BUCKETS_PATH.read_text())
    except (OSError, ValueError):
        return None


def wanted(env: str | None = None) -> int | None:
    """The bucket count set-up aims for: ``TARGET_BUCKETS``, ``$BELAYER_CONNTRACK_BUCKETS``
    (a number), or None for ``keep``."""
    value = os.environ.get(ENV, "") if env is None else env
    if value == "keep":
        return None
    if not value:
        return TARGET_BUCKETS
    if not value.isdigit() or not 1024 <= int(value) <= 1 << 22:
        raise ValueError(f"{ENV} must be 'keep' or a bucket count in 1024..{1 << 22}, got {value!r}")
    return int(value)


def tune(target: int | None = TARGET_BUCKETS, sysctl_file: Path | None = SYSCTL_FILE) -> str:
    """Lower the bucket count to ``target`` when larger (root) and write ``sysctl_file`` so a
    reboot keeps it (an existing one is kept in step); returns what it did, in words."""
    now = buckets()
    if now is None:
        return "no conntrack table in this kernel: nothing to walk"
    if target is None:
        return f"conntrack buckets kept at {now} ({ENV}=keep)"
    lowered = now > target
    if lowered:
        try:
            BUCKETS_PATH.write_text(f"{target}\n")
        except OSError as e:  # not the host's network namespace, or not root: captures work, slower
            return f"conntrack buckets left at {now}: {e}"
        now = buckets() or target
    persist = sysctl_file is not None and (lowered or sysctl_file.exists())
    if persist:
        _write_sysctl(sysctl_file, now)
    return (f"conntrack buckets {'lowered to ' if lowered else ''}{now}"
            + (f" (kept across reboots: {sysctl_file})" if persist else ""))


def _write_sysctl(path: Path, value: int) -> None:
    write_if_changed(path, f"# Belayer (belayer_env/host/conntrack.py): CRIU walks the whole conntrack table twice\n"
                           f"# inside every checkpoint's freeze; a smaller table keeps that walk short.\n"
                           f"net.netfilter.nf_conntrack_buckets = {value}\n", 0o644)


def walk_s() -> float:
    """Seconds one conntrack dump takes from this process's network namespace: the walk
    CRIU does twice per capture."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER) as sk:
        header = struct.pack("=IHHII", 20, _CT_GET, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        t0 = time.perf_counter()
        sk.send(header + struct.pack("=BBH", socket.AF_UNSPEC, 0, 0))
        while True:
            reply = sk.recv(1 << 16)
            offset = 0
            while offset + 16 <= len(reply):
                length, kind = struct.unpack_from("=IH", reply, offset)
                if kind == _NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", reply, offset + 16)
                    if code:
                        raise OSError(-code, f"conntrack dump: {os.strerror(-code)}")
                    return time.perf_counter() - t0
                if kind == _NLMSG_DONE:
                    return time.perf_counter() - t0
                offset += max((length + 3) & ~3, 16)


if __name__ == "__main__":  # `python3 belayer_env/host/conntrack.py` (scripts/setup.sh: needs no other package)
    try:
        print(tune(wanted()))
    except (ValueError, OSError) as e:
        print(f"conntrack: {e}", file=sys.stderr)
        sys.exit(2)
