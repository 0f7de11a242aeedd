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
  containers (Docker's own hook sets the same ``lo`` up a moment later). CRIU runs it at
  every stage (seven per restore, four per dump, three of them inside the freeze), so it
  is a static program where set-up can build one (``scripts/native/criu_loopback.c``,
  checked on a fresh network namespace before it is installed): ~0.5 ms a stage where the
  shell script (``HOOK_SCRIPT``, still the fallback) took ~2, and ~6 at setup-namespaces.
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
import subprocess
import time
from pathlib import Path

HOOK_PATH = Path("/usr/local/libexec/belayer-criu-loopback")
HOSTS_PATH = Path("/usr/local/share/belayer/hosts")
RUNC_CRIU_CONF = Path("/etc/criu/runc.conf")
"""The CRIU config file runc passes to CRIU (its ``org.criu.config`` default)."""

HOOK_SCRIPT = """#!/bin/sh
# Belayer (belayer_env/host/loopback.py): CRIU action script, listed in /etc/criu/runc.conf.
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

HOOK_SOURCE = "criu_loopback.c"
HOOK_MARK = b"belayer-criu-loopback static "
"""The static hook carries this string and its version (``belayer_mark`` in its source)."""
RELAY_MARK = HOOK_MARK + b"2"
"""A build that also relays Belayer's dumps (``belayer_env/criu/hooks.py``)."""

CONF_LINE = f"action-script {HOOK_PATH}"
HOOK_PATH_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def installed(conf: Path | None = None) -> bool:
    """True when sandboxes may be created with ``NetworkDisabled`` (module docstring)."""
    conf = conf or RUNC_CRIU_CONF
    try:
        listed = CONF_LINE in (line.strip() for line in conf.read_text().splitlines())
        return (listed and hook_kind() is not None and os.access(HOOK_PATH, os.X_OK)
                and HOSTS_PATH.read_text() == HOSTS)
    except OSError:
        return False


def relays(conf: Path | None = None) -> bool:
    """True when the listed hook also relays Belayer's dumps (then a dump needs no action
    script of its own: one exec per CRIU stage instead of two). Cached per file version."""
    conf = conf or RUNC_CRIU_CONF
    try:
        key = tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in (os.stat(conf), os.stat(HOOK_PATH)))
    except OSError:
        return False
    if _relays_cache.get(conf) is None or _relays_cache[conf][0] != key:
        try:
            ok = installed(conf) and RELAY_MARK in HOOK_PATH.read_bytes()
        except OSError:
            ok = False
        _relays_cache[conf] = (key, ok)
    return _relays_cache[conf][1]


_relays_cache: dict[Path, tuple[tuple, bool]] = {}


def hook_kind() -> str | None:
    """``"static"`` or ``"script"`` (the one this version writes), None for anything else."""
    try:
        hook = HOOK_PATH.read_bytes()
    except OSError:
        return None
    if hook[:4] == b"\x7fELF" and HOOK_MARK in hook:
        return "static"
    if hook == HOOK_SCRIPT.encode() and all(_tool(t) for t in ("ip", "nsenter")):
        return "script"
    return None


def _tool(name: str) -> bool:
    """On the hook's own PATH (CRIU runs it with whatever environment containerd has)."""
    return any(os.access(Path(d) / name, os.X_OK) for d in HOOK_PATH_DIRS)


def install(conf: Path | None = None) -> str:
    """Write the hook and the hosts file and list the hook in runc's CRIU config (root; idempotent)."""
    conf = conf or RUNC_CRIU_CONF
    kind = _install_hook()
    write_if_changed(HOSTS_PATH, HOSTS, 0o644)
    conf.parent.mkdir(parents=True, exist_ok=True)
    text = conf.read_text() if conf.exists() else ""
    if CONF_LINE not in (line.strip() for line in text.splitlines()):
        write_if_changed(conf, text + ("" if not text or text.endswith("\n") else "\n") + CONF_LINE + "\n", 0o644)
    return f"CRIU loopback hook {HOOK_PATH} ({kind}) listed in {conf}; hosts file {HOSTS_PATH}"


def _install_hook() -> str:
    """The static hook if it builds and brings ``lo`` up in a fresh namespace, else the script."""
    from belayer_env.host.native import NATIVE, BuildError, compile_static

    tmp = HOOK_PATH.with_name(f".{HOOK_PATH.name}.{os.getpid()}")
    try:
        HOOK_PATH.parent.mkdir(parents=True, exist_ok=True)
        libc = compile_static(tmp, [NATIVE / HOOK_SOURCE])
        try:
            check_hook(tmp)
        except BuildError:
            if libc == "glibc":
                raise
            libc = compile_static(tmp, [NATIVE / HOOK_SOURCE], libc="glibc")  # musl's build failed its check
            check_hook(tmp)
        os.replace(tmp, HOOK_PATH)
        return f"static, {libc}"
    except (BuildError, OSError, subprocess.SubprocessError) as e:
        write_if_changed(HOOK_PATH, HOOK_SCRIPT, 0o755)
        return f"shell script: no static build ({str(e)[:200]})"
    finally:
        tmp.unlink(missing_ok=True)


def check_hook(hook: Path) -> None:
    """``BuildError`` unless ``hook`` does nothing at another stage and sets ``lo`` up in the
    network namespace of ``CRTOOLS_INIT_PID`` at setup-namespaces (root: a fresh namespace)."""
    from belayer_env.host.native import BuildError

    def run(action: str, pid: int) -> subprocess.CompletedProcess:
        return subprocess.run([str(hook)], env={"CRTOOLS_SCRIPT_ACTION": action, "CRTOOLS_INIT_PID": str(pid)},
                              capture_output=True, text=True, timeout=30)

    def lo_flags(pid: int) -> str:
        out = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-o", "link", "show", "lo"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.split("<", 1)[1].split(">", 1)[0] if "<" in out else ""

    os.chmod(hook, 0o755)
    fresh = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{fresh.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            if time.monotonic() > deadline:
                raise BuildError("unshare --net did not give sleep a namespace of its own within 10 s")
            time.sleep(0.01)  # bounded: until unshare has exec'd sleep in the new namespace
        if "UP" in lo_flags(fresh.pid).split(","):
            raise BuildError("lo of a fresh namespace is already up: nothing to check")
        if (r := run("post-dump", fresh.pid)).returncode != 0 or "UP" in lo_flags(fresh.pid).split(","):
            raise BuildError(f"it did something at another stage ({r.returncode}: {r.stderr.strip()})")
        if (r := run("setup-namespaces", fresh.pid)).returncode != 0:
            raise BuildError(f"it failed at setup-namespaces ({r.returncode}: {r.stderr.strip()})")
        if "UP" not in lo_flags(fresh.pid).split(","):
            raise BuildError("lo is not up after setup-namespaces")
    finally:
        fresh.kill()
        fresh.wait()


def write_if_changed(path: Path, text: str, mode: int) -> None:
    """Atomic write (a restore running meanwhile reads the old or the new file, never half);
    a file that already says ``text`` with ``mode`` is left alone."""
    try:
        if path.read_bytes() == text.encode() and (path.stat().st_mode & 0o7777) == mode:  # may be a binary now
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



if __name__ == "__main__":  # `python3 belayer_env/host/loopback.py` (scripts/setup.sh: needs no other package)
    print(install())
