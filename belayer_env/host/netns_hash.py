"""Socket hash tables of their own for new network namespaces: CRIU walks them inside every freeze.

Why this matters: to find a sandbox's sockets CRIU asks the kernel's sock_diag for every
TCP and UDP socket, over IPv4 and IPv6, from inside the sandbox's network namespace. By
default every namespace shares the host's tables, and a dump visits every bucket whatever
the namespace holds: with the 262,144-bucket TCP table of a host with 24 GiB that cost
~1.5 ms per family on the 2-core VM here, 3-5 ms of every frozen window (an idle sandbox's
capture was frozen 44.4 ms p50 with the shared tables, 39.8 with its own; 12 captures each,
interleaved). Since Linux 6.1 (TCP) and 6.2 (UDP), ``net.ipv4.tcp_child_ehash_entries`` and
``net.ipv4.udp_child_hash_entries`` give each network namespace created afterwards a table
of that size of its own.

``tune()`` (``bash scripts/setup.sh``) sets both to ``TARGET_ENTRIES`` where they are 0 (a
value someone chose is kept) and keeps them so across reboots (``SYSCTL_FILE``). What it
changes, host-wide: every network namespace created afterwards (each container's, with or
without network) gets tables of that size; a container with many thousands of connections
walks longer chains. The host's own namespace keeps its tables. ``BELAYER_NETNS_HASH=keep``
at set-up leaves the settings alone; a number sets that size. Sandboxes that existed before
keep the shared tables until they are restored or recreated.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __package__:
    from belayer_env.host.loopback import write_if_changed
else:  # `python3 belayer_env/host/netns_hash.py` (set-up): the sibling module, without the package
    from loopback import write_if_changed

SETTINGS = {"tcp": Path("/proc/sys/net/ipv4/tcp_child_ehash_entries"),
            "udp": Path("/proc/sys/net/ipv4/udp_child_hash_entries")}
SYSCTL_FILE = Path("/etc/sysctl.d/60-belayer-netns-hash.conf")
TARGET_ENTRIES = 1024
"""A namespace's own TCP and UDP tables: a walk of 1,024 buckets costs microseconds."""
ENV = "BELAYER_NETNS_HASH"


def sizes() -> dict[str, int]:
    """The current settings (0: new namespaces share the host's table); a setting this kernel
    lacks is left out."""
    out = {}
    for proto, path in SETTINGS.items():
        try:
            out[proto] = int(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def wanted(env: str | None = None) -> int | None:
    """The size set-up aims for: ``TARGET_ENTRIES``, ``$BELAYER_NETNS_HASH`` (a power of two
    in 128..65536), or None for ``keep``."""
    value = os.environ.get(ENV, "") if env is None else env
    if value == "keep":
        return None
    if not value:
        return TARGET_ENTRIES
    if not value.isdigit() or not 128 <= int(value) <= 1 << 16 or int(value) & (int(value) - 1):
        raise ValueError(f"{ENV} must be 'keep' or a power of two in 128..65536, got {value!r}")
    return int(value)


def tune(target: int | None = TARGET_ENTRIES, sysctl_file: Path | None = SYSCTL_FILE) -> str:
    """Give new namespaces tables of ``target`` buckets where they would share the host's
    (root), and write ``sysctl_file`` so a reboot keeps it; returns what it did, in words."""
    now = sizes()
    if not now:
        return "this kernel has no per-namespace socket tables (Linux >= 6.2): captures walk the host's"
    if target is None:
        return f"socket tables of new namespaces kept ({describe(now)}; {ENV}=keep)"
    changed = []
    for proto, value in now.items():
        if value == 0:
            try:
                SETTINGS[proto].write_text(f"{target}\n")
            except OSError as e:  # not the host's network namespace, or not root: captures work, slower
                return f"socket tables of new namespaces left at {describe(now)}: {e}"
            changed.append(proto)
    now = sizes()
    persist = sysctl_file is not None and (changed or sysctl_file.exists())
    if persist:
        write_if_changed(sysctl_file, "# Belayer (belayer_env/host/netns_hash.py): CRIU walks a sandbox's socket tables\n"
                                      "# inside every checkpoint's freeze; tables of its own keep that walk short.\n"
                         + "".join(f"net.ipv4.{SETTINGS[p].name} = {v}\n" for p, v in now.items()), 0o644)
    return (f"socket tables of new namespaces: {describe(now)}" + (" (set now)" if changed else "")
            + (f" (kept across reboots: {sysctl_file})" if persist else ""))


def ok(values: dict[str, int] | None = None) -> bool:
    """Every setting this kernel has gives new namespaces a table of their own."""
    values = sizes() if values is None else values
    return bool(values) and all(v > 0 for v in values.values())


def describe(values: dict[str, int]) -> str:
    """The settings in words (``sizes()``): "TCP 1024, UDP shared with the host"."""
    return ", ".join(f"{p.upper()} {v or 'shared with the host'}" for p, v in values.items())


if __name__ == "__main__":  # `python3 belayer_env/host/netns_hash.py` (scripts/setup.sh: needs no other package)
    try:
        print(tune(wanted()))
    except (ValueError, OSError) as e:
        print(f"netns hash: {e}", file=sys.stderr)
        sys.exit(2)
