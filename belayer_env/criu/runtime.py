"""Runtime state (every process of the container) with CRIU, driven through runc.

Dump: ``runc checkpoint --leave-running`` against Docker's own runc state directory, into
tmpfs. Measured here for a 50 MiB python heap: 0.21 s, against 1.3 s for Docker's
checkpoint API, which routes the same CRIU images through containerd's content store and
back (two extra copies and a tar). In the default (incremental) capture CRIU's action
scripts call back into Belayer, which freezes the cgroup only once CRIU has started and
thaws it as soon as CRIU lets go (``criu/hooks.py``); in the ``paused`` capture the caller
pauses the container first. Either way the file-system layer is captured from the same
frozen instant.

Restore has to go through Docker so that Docker, containerd and the shim own the restored
container: the (verified) images reach the new container's checkpoint directory as
relative symlinks (``images="linked"``, the default) or copies, then
``POST /containers/{id}/start?checkpoint=NAME``. CRIU options for that restore come from
``/etc/criu/runc.conf`` (``tcp-established``, ``file-locks``: scripts/setup.sh writes it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from belayer_core.errors import UsageError
from belayer_core.procfs import session_members
from belayer_env.criu import cgroup_yard, helpers
from belayer_env.criu.hooks import CriuError, FreezeHooks, HookRelay
from belayer_env.host import fast_tar, loopback
from belayer_env.store.manifest import check_file, copy_hashed

RUNC_ROOT = os.environ.get("BELAYER_RUNC_ROOT", "/run/docker/runtime-runc/moby")
RUNC = os.environ.get("BELAYER_RUNC", "runc")
CRIU_OPTS = ["--leave-running", "--tcp-established", "--file-locks"]
DUMP_TIMEOUT_S = float(os.environ.get("BELAYER_CRIU_TIMEOUT_S", "60"))
"""A dump still running after this is killed (runc, CRIU and CRIU's helpers) and fails."""
CRIU_EXTRA_CONFIG = os.environ.get("BELAYER_CRIU_EXTRA_CONFIG", "")
"""Test-only seam, empty by default: extra lines for the CRIU config file of every dump. The
fault tests put an ``action-script`` here that holds CRIU stopped mid-dump (see
tests/belayer_env/conftest_checkpoint.py, ``CriuHold``)."""


def _switch(name: str) -> bool:
    """An on/off knob of the environment, on by default: ``0`` or ``1``, else a UsageError."""
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise UsageError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


CGROUP_YARD = _switch("BELAYER_CRIU_CGROUP_YARD")
"""Dumps walk the host's own cgroup mounts (``cgroup_yard``); ``0``: CRIU mounts its own."""
FAST_TAR = _switch("BELAYER_CRIU_FAST_TAR")
"""Dumps find ``fast_tar``'s helper first in PATH when it is installed; ``0``: GNU tar."""
NATIVE_RELAY = _switch("BELAYER_CRIU_NATIVE_RELAY")
"""Dumps are relayed by the static hook set-up lists in runc's CRIU config where it can
(``hooks.HookRelay``); ``0``: by a shell script of each dump's own (one more exec per stage)."""
CRIU_NICE = int(os.environ.get("BELAYER_CRIU_NICE", "-10"))
"""Nice value of the autogroup (the session) of runc, CRIU and the helpers CRIU spawns (tar,
ip, ...), and of the layer copy while frozen: on a busy host the frozen window is mostly
waiting for a CPU. Sessions are scheduled as groups (``sched_autogroup``), so the session's
nice is what counts, not a process's own. 0: unchanged."""
_POLL_S = 0.02


def boost(pid: int) -> None:
    """Give the session of ``pid`` (its own: ``start_new_session``) the ``CRIU_NICE`` nice."""
    if CRIU_NICE:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(CRIU_NICE))


def available(container_id: str | None = None) -> str | None:
    """None when runtime checkpoints can work here, else the reason they cannot."""
    if not shutil.which(RUNC):
        return f"{RUNC} not found in PATH"
    if not shutil.which("criu") and not os.path.exists("/usr/local/sbin/criu"):
        return "criu not installed (bash scripts/setup.sh builds it)"
    if container_id and not os.path.exists(os.path.join(RUNC_ROOT, container_id, "state.json")):
        return f"no runc state for {container_id[:12]} under {RUNC_ROOT} (set BELAYER_RUNC_ROOT)"
    return None


def dump(container_id: str, images: Path, work: Path, *, isolated: bool = True,
         abort: threading.Event | None = None, timeout_s: float | None = None,
         hooks: FreezeHooks | None = None, boosted: bool = True,
         orphan_thaw: tuple[Path, str] | None = None, ghost_limit: int | None = None) -> None:
    """CRIU-dump the (paused) container's process tree into ``images``; it keeps running.

    ``isolated`` (no network): nothing outside can talk to the frozen sockets, so CRIU's
    network lock (iptables/nft in the container's netns, ~60 ms around the dump) is
    skipped via an extra CRIU config file (which also carries ``CRIU_EXTRA_CONFIG``);
    runc's /etc/criu/runc.conf still applies.

    runc and CRIU run in a session of their own. When ``abort`` is set, or the dump runs
    past ``timeout_s`` (default ``DUMP_TIMEOUT_S``), that whole session is SIGKILLed: a
    container killed mid-dump otherwise deadlocks with CRIU (its init waits in
    zap_pid_ns_processes for children that CRIU holds ptrace-stopped, while CRIU waits
    for the init), and the container can then be neither removed nor restored. Killing
    CRIU may leave the container's processes half-dumped: abort only a sandbox that is
    about to be fenced anyway.

    ``hooks``: CRIU freezes the container itself (its start-up, kernel probing and runc's
    own work then run before the freeze, not inside it) and calls ``hooks.frozen()``
    once the processes are stopped and ``hooks.before_resume()`` after the images are
    written, with the processes still stopped (CRIU action scripts ``network-lock`` and
    ``post-dump``, relayed through two FIFOs in ``work``). What the caller captures
    between the two belongs to the same frozen instant as the images. An exception from
    ``before_resume`` fails the dump (CRIU resumes the processes) and is re-raised.
    ``boosted``: runc and CRIU run at ``CRIU_NICE``. ``orphan_thaw``: see ``HookRelay``.
    ``ghost_limit``: the largest deleted-but-open file CRIU copies into the images (its
    default, 1 MiB, fails the dump of any process holding a bigger temp file); the caller
    passes what the sandbox's memory allows.

    runc, CRIU, the action scripts and their helpers carry ``helpers.MARKER`` in their
    environment (this process's owner id): ``belayer gc`` ends them once it is dead.
    A failed dump raises ``CriuError`` whose ``reason`` is CRIU's own error in one line.
    """
    images.mkdir(mode=0o700)
    work.mkdir(mode=0o700)
    env = {**os.environ, **helpers.marker_env(container_id, orphan_thaw)}
    if FAST_TAR and fast_tar.installed():
        env["PATH"] = fast_tar.dump_path(env.get("PATH"))  # CRIU's tmpfs dumps, in-process
    lines = (["network-lock skip"] if isolated else []) + ([f"ghost-limit {ghost_limit}"] if ghost_limit else [])
    lines += [CRIU_EXTRA_CONFIG] if CRIU_EXTRA_CONFIG else []
    if CGROUP_YARD and (yard := cgroup_yard.make(work)) is not None:
        lines.append(f"cgroup-yard {yard}")  # no cgroup mounts inside the freeze (cgroup_yard)
    relay = (HookRelay(work, hooks, DUMP_TIMEOUT_S if timeout_s is None else timeout_s, orphan_thaw,
                       native=NATIVE_RELAY and loopback.relays()) if hooks else None)
    if relay is not None:
        lines += relay.config_lines
        env |= relay.env
    if lines:
        conf = work / "criu.conf"
        conf.write_text("\n".join(lines) + "\n")
        env["CRIU_CONFIG_FILE"] = str(conf)
    argv = [RUNC, "--root", RUNC_ROOT, "checkpoint", *CRIU_OPTS,
            "--image-path", str(images), "--work-path", str(work), container_id]
    timeout_s = DUMP_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        _run_dump(argv, env, work, abort, timeout_s, boosted)
    except CriuError:
        if relay is not None and relay.error is not None:
            raise relay.error from None  # what the caller's hook said (e.g. a layer too large)
        raise
    finally:
        if relay is not None:
            relay.close()
    if relay is not None:
        relay.check()


def _run_dump(argv: list[str], env: dict[str, str], work: Path, abort: threading.Event | None,
              timeout_s: float, boosted: bool) -> None:
    with open(work / "runc.err", "w+") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                env=env, start_new_session=True)
        if boosted:
            boost(proc.pid)
        deadline = time.monotonic() + timeout_s
        stop = None
        while stop is None:
            try:
                proc.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if abort is not None and abort.is_set():
                    stop = "aborted"
                elif time.monotonic() >= deadline:
                    stop = f"timed out after {timeout_s:g} s"
        if stop is not None:
            kill_session(proc.pid)
            proc.wait()
            raise CriuError(f"runc checkpoint {stop}; runc and CRIU were killed{_log_tail(work / 'dump.log')}",
                            reason=f"the CRIU dump {stop}")
        err.seek(0)
        stderr = err.read()
    if proc.returncode != 0:
        reason = criu_reason(work / "dump.log") or (stderr.strip().splitlines() or ["runc checkpoint failed"])[-1]
        raise CriuError(f"{reason} (runc checkpoint failed ({proc.returncode}): {stderr.strip()[-300:]}"
                        f"{_log_tail(work / 'dump.log')})", reason=reason[:REASON_CHARS])


def kill_session(sid: int) -> list[int]:
    """SIGKILL every process of session ``sid`` (runc is its leader; CRIU and its helpers
    inherit it), scanning again until a scan finds no live member it has not signalled: a
    child forked after one scan and before its parent's SIGKILL shows in the next (once
    signalled, a process forks no more). CRIU forks such children early in every dump
    (``fork_and_ptrace_attach``'s helper, which sleeps until killed): one scan left them
    orphaned for good. Returns the pids signalled."""
    killed: list[int] = []
    while new := [pid for pid in session_members(sid, live=True) if pid not in killed]:
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


REASON_CHARS = 300
_HARMLESS = ("Can't setup RLIMIT_NOFILE",)  # CRIU's own warnings logged as errors, seen on every dump here
_LOCATION = re.compile(r"^\(\s*[\d.]+\)\s+Error\s+\([^)]*\):\s*")


def criu_reason(log: Path) -> str | None:
    """The first real error of a CRIU log, in one line (``criu: <what CRIU said>``), without
    its time stamp and source location; None when the log has none."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in text:
        m = _LOCATION.match(line)
        if m and not any(h in line for h in _HARMLESS):
            return "criu: " + line[m.end():].strip()
    return None


def _log_tail(log: Path, lines: int = 8) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errs = [ln for ln in text if "Error" in ln or "err" in ln.lower()][-lines:]
    return "; criu: " + " | ".join(errs or text[-lines:]) if text else ""


def install(src: Path, files: dict[str, dict[str, Any]], dest: Path, *, link: bool = True) -> None:
    """Put the runtime images into ``dest`` (hardlink, else copy), verifying each one.

    ``link=False`` always copies: the verified bytes are then independent of the store's
    files (a pre-staged copy kept until a later restore).
    """
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    for rel, meta in files.items():
        if not rel.startswith("runtime/"):
            continue
        target = dest / rel.removeprefix("runtime/")
        try:  # same file system: a hardlink (Docker and CRIU only read the images)
            if not link:
                raise OSError("copy asked for")
            os.link(src / rel, target)
            with open(target, "rb") as fi:
                size, digest = copy_hashed(fi, _Discard())
        except OSError:
            with open(src / rel, "rb") as fi, open(target, "wb") as fo:
                size, digest = copy_hashed(fi, fo)
        try:
            check_file(rel, meta, size, digest)
        except ValueError as e:
            raise CriuError(str(e)) from e


class _Discard:
    def write(self, _b: bytes) -> None:
        pass


def start_from(client: Any, container_id: str, name: str) -> None:
    """Start a created container from its checkpoint ``name`` (CRIU restore via runc)."""
    api = client.api
    res = api.post(api._url("/containers/{0}/start", container_id), params={"checkpoint": name})
    api._raise_for_status(res)
