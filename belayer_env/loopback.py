"""Sandboxes without Docker's network stack: a CRIU hook brings a restored sandbox's loopback up.

Why: a sandbox without network (the default) still got Docker's network sandbox, and with
it Docker's ``libnetwork-setkey`` prestart hook: dockerd's binary started again for every
start and every CRIU restore (~100 ms of a restore on a quiet machine, 110-250 ms under
load; ~half of a cold start). ``NetworkDisabled`` at create drops all of it. What it drops
too: (1) the hook is what brings ``lo`` up in a *restored* container's new network
namespace (runc has CRIU treat the namespace as empty, so its state is never in the
images): without it a server on 127.0.0.1 is unreachable after a restore; (2) Docker's
``/etc/hosts`` mount (``localhost`` would not resolve).

So a sandbox is created with ``NetworkDisabled`` only where this host has both fixes
installed (``installed()``; ``bash scripts/setup.sh`` runs ``install()``):

- ``HOOK_PATH``, a CRIU action script listed in ``/etc/criu/runc.conf`` (the CRIU config
  file runc has CRIU read for every dump and restore): at CRIU's ``setup-namespaces`` stage
  of a restore, before any restored process runs, it sets ``lo`` up in the new
  namespace; at every other stage it exits at once. Host-wide, and harmless for other
  containers (Docker's own hook sets the same ``lo`` up a moment later).
- ``HOSTS_PATH``, mounted read-only as the sandbox's ``/etc/hosts``: Docker's file for a
  container without network, minus its per-container writability (edits to a bind-mounted
  ``/etc/hosts`` were never in a checkpoint's layer anyway).

A checkpoint records how its container was made (manifest ``network_disabled``) and a
restore makes the new container the same way (CRIU needs the same mounts); the restore
checks that ``lo`` is up before it returns. Checkpoints made before this keep Docker's
network stack on restore.
"""

from __future__ import annotations

import os
from pathlib import Path

HOOK_PATH = Path("/usr/local/libexec/belayer-criu-loopback")
HOSTS_PATH = Path("/usr/local/share/belayer/hosts")
RUNC_CRIU_CONF = Path("/etc/criu/runc.conf")
"""The CRIU config file runc passes to CRIU (its ``org.criu.config`` default)."""

HOOK_SCRIPT = """#!/bin/sh
# Belayer (belayer_env/loopback.py): CRIU action script, listed in /etc/criu/runc.conf.
# A container restored by runc gets a new, empty network namespace; Docker's network
# hook brings its loopback up, but sandboxes created with NetworkDisabled have no such
# hook. At setup-namespaces (before any restored process runs) set lo up in it.
[ "$CRTOOLS_SCRIPT_ACTION" = setup-namespaces ] || exit 0
[ -n "$CRTOOLS_INIT_PID" ] || exit 0
PATH=/usr/sbin:/usr/bin:/sbin:/bin
exec nsenter --net="/proc/$CRTOOLS_INIT_PID/ns/net" ip link set lo up
"""

HOSTS = """127.0.0.1\tlocalhost
::1\tlocalhost ip6-localhost ip6-loopback
fe00::0\tip6-localnet
ff00::0\tip6-mcastprefix
ff02::1\tip6-allnodes
ff02::2\tip6-allrouters
"""

CONF_LINE = f"action-script {HOOK_PATH}"
HOOK_PATH_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def installed(conf: Path | None = None) -> bool:
    """True when sandboxes may be created with ``NetworkDisabled`` (module docstring)."""
    conf = conf or RUNC_CRIU_CONF
    try:
        listed = CONF_LINE in (line.strip() for line in conf.read_text().splitlines())
        return (listed and HOOK_PATH.read_text() == HOOK_SCRIPT and os.access(HOOK_PATH, os.X_OK)
                and HOSTS_PATH.read_text() == HOSTS and all(_tool(t) for t in ("ip", "nsenter")))
    except OSError:
        return False


def _tool(name: str) -> bool:
    """On the hook's own PATH (CRIU runs it with whatever environment containerd has)."""
    return any(os.access(Path(d) / name, os.X_OK) for d in HOOK_PATH_DIRS)


def install(conf: Path | None = None) -> str:
    """Write the hook and the hosts file and list the hook in runc's CRIU config (root; idempotent)."""
    conf = conf or RUNC_CRIU_CONF
    write_if_changed(HOOK_PATH, HOOK_SCRIPT, 0o755)
    write_if_changed(HOSTS_PATH, HOSTS, 0o644)
    conf.parent.mkdir(parents=True, exist_ok=True)
    text = conf.read_text() if conf.exists() else ""
    if CONF_LINE not in (line.strip() for line in text.splitlines()):
        write_if_changed(conf, text + ("" if not text or text.endswith("\n") else "\n") + CONF_LINE + "\n", 0o644)
    return f"CRIU loopback hook {HOOK_PATH} listed in {conf}; hosts file {HOSTS_PATH}"


def write_if_changed(path: Path, text: str, mode: int) -> None:
    """Atomic write (a restore running meanwhile reads the old or the new file, never half);
    a file that already says ``text`` with ``mode`` is left alone."""
    try:
        if path.read_text() == text and (path.stat().st_mode & 0o7777) == mode:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def loopback_up(pid: int) -> bool | None:
    """Whether ``lo`` is up in the network namespace of process ``pid`` (None: cannot tell).

    Read through the process's own ``/sys`` (sysfs shows the namespace it was mounted in,
    which CRIU re-mounts in the restored one)."""
    try:
        flags = int(Path(f"/proc/{pid}/root/sys/class/net/lo/flags").read_text(), 16)
    except (OSError, ValueError):
        return None
    return bool(flags & 0x1)  # IFF_UP



if __name__ == "__main__":  # `python3 belayer_env/loopback.py` (scripts/setup.sh: needs no other package)
    print(install())
