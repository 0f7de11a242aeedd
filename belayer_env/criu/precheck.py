"""What CRIU cannot dump (or restore), found before anything is frozen.

A process traced by another one (a debugger, ``strace -p``, a child that called
``PTRACE_TRACEME``) cannot be seized by CRIU: a task has one tracer at a time. CRIU then
retries for its whole seize timeout (10 s) with the sandbox frozen and fails anyway. A
stopped process (SIGSTOP, job control) is worse: seizing it wakes it to re-trap, which it
cannot do in a frozen cgroup, and CRIU waits in ``ptrace_attach`` until the dump's timeout
(60 s) kills it. Such dumps are refused at once instead, with the reason in one line.

A tmpfs of the sandbox (``/dev/shm``, ...) holding a path past PATH_MAX is dumped, but
CRIU's restore unpacks it with GNU tar, which cannot make such a path: the checkpoint would
be ready and never restorable. It is refused too (the writable layer's long paths are
handled: ``store/long_paths.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from belayer_env.store.long_paths import LONG

MAX_TMPFS_ENTRIES = 200_000
"""A tmpfs walk stops after this many entries (the sandbox's tmpfs mounts are small)."""


def _status(task: Path) -> dict[str, str]:
    out = {}
    try:
        for line in (task / "status").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            out[key] = value.strip()
    except OSError:
        return {}
    return out


def _in_container(status: dict[str, str], host_pid: int) -> str:
    """The pid as the container sees it (last of ``NSpid``), else the host's."""
    nspid = status.get("NSpid", "").split()
    return nspid[-1] if nspid else str(host_pid)


def traced_task(procs: Path) -> str | None:
    """Why CRIU cannot dump the processes listed in ``procs`` (a cgroup's ``cgroup.procs``)
    because one of their threads is traced or stopped, in one line; None when none is."""
    try:
        pids = [int(p) for p in procs.read_text().split()]
    except (OSError, ValueError):
        return None
    for pid in pids:
        try:
            tasks = sorted(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            st = _status(task)
            tracer = int(st.get("TracerPid", "0") or 0)
            if st.get("State", "").startswith("T") and not tracer:
                return (f"process {_in_container(st, pid)} ({st.get('Name', '?')}) is stopped (SIGSTOP or job "
                        "control): CRIU cannot seize a stopped process in a frozen cgroup (the dump would hang "
                        "until its timeout); continue it (kill -CONT) or end it")
            if tracer:
                tst = _status(Path(f"/proc/{tracer}"))
                if tst.get("Name") == "criu":  # an earlier dump still letting go: this one's CRIU waits for it
                    return None
                return (f"process {_in_container(st, pid)} ({st.get('Name', '?')}) is traced by process "
                        f"{_in_container(tst, tracer)} ({tst.get('Name', '?')}): CRIU cannot checkpoint a "
                        "traced process (a debugger or strace attached); detach or end it")
    return None


def _tmpfs_mounts(init_pid: int) -> list[str]:
    try:
        lines = Path(f"/proc/{init_pid}/mountinfo").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields = head.split()
        if len(fields) >= 5 and tail.split()[:1] == ["tmpfs"]:
            out.append(fields[4].encode().decode("unicode_escape"))  # mountinfo escapes spaces as \040
    return out


def long_tmpfs_path(init_pid: int) -> str | None:
    """Why a dump of the container whose init is ``init_pid`` could not be restored because
    one of its tmpfs mounts holds a path past PATH_MAX, in one line; None when none does."""
    walked = 0
    for mount in _tmpfs_mounts(init_pid):
        top = f"/proc/{init_pid}/root{mount}"
        try:
            dev = os.stat(top).st_dev
        except OSError:
            continue
        for root, dirs, files, fd in os.fwalk(top):
            if os.fstat(fd).st_dev != dev:  # another mount below this one: checked on its own
                dirs[:] = []
                continue
            rel = root[len(top):]
            for name in (*dirs, *files):
                if len(os.fsencode(f".{rel}/{name}")) >= LONG:
                    return (f"the tmpfs at {mount} holds a path of more than {LONG} bytes, which CRIU's restore "
                            f"cannot unpack (PATH_MAX): {mount}{rel[:60]}...")
            walked += len(dirs) + len(files)
            if walked > MAX_TMPFS_ENTRIES:
                return None
    return None


def undumpable(freezer_control: Path | None, init_pid: int) -> str | None:
    """Why a dump of the container (its freezer control file, its init's host pid) would fail
    or could never be restored, in one line; None when nothing known stands in the way."""
    return ((traced_task(freezer_control.parent / "cgroup.procs") if freezer_control is not None else None)
            or (long_tmpfs_path(init_pid) if init_pid else None))
