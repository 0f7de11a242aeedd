"""What CRIU cannot dump, found before anything is frozen.

A process traced by another one (a debugger, ``strace -p``, a child that called
``PTRACE_TRACEME``) cannot be seized by CRIU: a task has one tracer at a time. CRIU then
retries for its whole seize timeout (10 s) with the sandbox frozen and fails anyway. Such a
dump is refused at once instead, with the reason in one line.
"""

from __future__ import annotations

from pathlib import Path


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
    because one of their threads is traced, in one line; None when none is."""
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
            if tracer:
                tst = _status(Path(f"/proc/{tracer}"))
                return (f"process {_in_container(st, pid)} ({st.get('Name', '?')}) is traced by process "
                        f"{_in_container(tst, tracer)} ({tst.get('Name', '?')}): CRIU cannot checkpoint a "
                        "traced process (a debugger or strace attached); detach or end it")
    return None
