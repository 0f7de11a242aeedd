"""A container's freezer cgroup, read and thawed directly (cgroup v1 or v2).

Docker pauses a container through this cgroup. When an exec races a pause, the exec's
``runc init`` can be frozen half-way into the container (D state, in the refrigerator):
Docker then answers nothing about that container (inspect, unpause, kill all hang) while
the cgroup stays FROZEN. Writing THAWED (v1) / 0 (v2) to the cgroup is what Docker's
unpause would have done; it lets the stuck exec finish and Docker answer again.

The other way round: CRIU thaws the cgroup once it has seized the processes and freezes it
again at the end of its dump, so a CRIU killed in between leaves a container Docker holds
paused running; Docker's unpause then fails ("container not paused") until it is frozen again.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
THAW_WAIT_S = 5.0
# a cgroup directory removed (ENOENT) or being removed (ENODEV) since it was found: the kernel
# removes only an empty one, so none of its processes is left
CGROUP_GONE = (errno.ENOENT, errno.ENODEV)


def _candidates(container_id: str) -> list[Path]:
    """Where Docker puts the container's freezer control file (cgroupfs or systemd driver)."""
    v1 = CGROUP_ROOT / "freezer"
    v2_files = [CGROUP_ROOT / "system.slice" / f"docker-{container_id}.scope" / "cgroup.freeze",
                CGROUP_ROOT / "docker" / container_id / "cgroup.freeze"]
    v1_files = [v1 / "docker" / container_id / "freezer.state",
                v1 / "system.slice" / f"docker-{container_id}.scope" / "freezer.state"]
    return v1_files + v2_files


def control_file(container_id: str) -> Path | None:
    """The container's freezer control file, or None (no such cgroup here: e.g. a remote daemon)."""
    for path in _candidates(container_id):
        if path.exists():
            return path
    return None


def is_frozen(container_id: str) -> bool:
    """True while the container's cgroup is FROZEN or FREEZING (v2: ``cgroup.freeze`` is 1)."""
    path = control_file(container_id)
    if path is None:
        return False
    try:
        state = path.read_text().strip()
    except OSError:
        return False
    return state in ("FROZEN", "FREEZING") if path.name == "freezer.state" else state == "1"


def no_process_left(container_id: str) -> bool:
    """True when the container's cgroup exists here and holds no process, or was removed
    since it was found (dead in the kernel's view, whatever Docker's state says yet); False
    when it holds one or is unknown."""
    return procs(container_id) == []


def thaw(container_id: str, wait_s: float = THAW_WAIT_S) -> bool:
    """Thaw the container's cgroup; True once it is thawed (or gone), False if it stays frozen."""
    return _write_until(container_id, ("THAWED", "0"), lambda path: not is_frozen(container_id),
                        gone=True, wait_s=wait_s)


def _write_until(container_id: str, values: tuple[str, str], reached, gone: bool, wait_s: float,
                 poll_s: float = 0.02) -> bool:
    """Write the freezer's control file (v1 value, v2 value) until ``reached(path)``; ``gone``
    is the answer when the cgroup disappears meanwhile (no such cgroup here: True)."""
    path = control_file(container_id)
    if path is None:
        return True
    value = values[0] if path.name == "freezer.state" else values[1]
    deadline = time.monotonic() + wait_s
    while True:
        try:
            path.write_text(value)
        except FileNotFoundError:
            return gone
        except OSError:
            return False
        if reached(path):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def _fully_frozen(path: Path) -> bool:
    """Frozen in fact, not only asked to be (v2: ``cgroup.events`` says ``frozen 1``)."""
    try:
        if path.name == "freezer.state":
            return path.read_text().strip() == "FROZEN"
        return "frozen 1" in (path.parent / "cgroup.events").read_text().splitlines()
    except OSError:
        return False


def freeze(container_id: str, wait_s: float = THAW_WAIT_S, poll_s: float = 0.02) -> bool:
    """Freeze the container's cgroup; True once it is frozen (or there is no such cgroup here),
    False if it is gone or does not freeze within ``wait_s`` (checked every ``poll_s``)."""
    return _write_until(container_id, ("FROZEN", "1"), _fully_frozen, gone=False, wait_s=wait_s, poll_s=poll_s)


def kill_all(container_id: str, init_pid: int, wait_s: float = 30.0) -> bool:
    """SIGKILL the container's init directly and wait until its cgroup holds no process.

    Why: Docker's kill waits for its own bookkeeping (containerd's exit event), ~200 ms on a
    quiet host, while the kernel has the processes dead in ~10 ms: the init's death kills
    its whole pid namespace, execs included. Done only when ``init_pid`` is in the
    container's cgroup (a pid Docker reported may have been reused); "dead" is the
    cgroup's own ``cgroup.procs`` empty, not Docker's view. False (nothing done, or not
    confirmed in ``wait_s``): the caller falls back to Docker's kill. A cgroup that holds no
    process already counts as dead (a container killed so a moment ago, Docker not yet told)."""
    path = control_file(container_id)
    if path is None or init_pid <= 0:
        return False
    alive = _cgroup_procs(path.parent)
    if alive == []:
        return True
    if alive is None or init_pid not in alive:
        return False
    try:
        os.kill(init_pid, signal.SIGKILL)
    except OSError:  # ProcessLookupError included: already gone
        return False
    deadline = time.monotonic() + wait_s
    while (left := _cgroup_procs(path.parent)) is not None:
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return False


def procs(container_id: str) -> list[int] | None:
    """The pids in the container's cgroup ([] once it is dead or its cgroup gone; None: no
    cgroup of it here to read, e.g. a remote daemon's container)."""
    path = control_file(container_id)
    return None if path is None else _cgroup_procs(path.parent)


def _cgroup_procs(cgroup: Path) -> list[int] | None:
    """The pids in ``cgroup`` ([] once it is removed: only an empty one can be); None when it
    cannot be read for another reason."""
    try:
        return [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    except OSError as exc:
        return [] if exc.errno in CGROUP_GONE else None
    except ValueError:
        return None


def _namespace_init(pids: list[int]) -> int | None:
    """The one of ``pids`` that is pid 1 of its own pid namespace (the container's init)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        if line.split()[-1] == "1":
                            return pid
                        break
        except OSError:
            continue
    return None


def init_alive(container_id: str, init_pid: int) -> bool:
    """True when ``init_pid`` is in the container's cgroup and not a zombie (the kernel's
    view of a running container; Docker's state says so only later)."""
    if init_pid <= 0 or init_pid not in (procs(container_id) or ()):
        return False
    try:
        with open(f"/proc/{init_pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill_cgroup(container_id: str, wait_s: float = 5.0, *, local: bool = False) -> bool | None:
    """Kill every process of the container through the kernel alone (no Docker call, no
    pid from Docker): thaw its cgroup if frozen, SIGKILL the pid-namespace init found in it
    (its death ends the whole namespace) through a pidfd taken while the pid was in the
    cgroup (a pid reused meanwhile is never signalled), or every listed process where no
    init is left. True once the cgroup holds no process; None: no cgroup of it here (the
    caller uses Docker's kill); False: not confirmed within ``wait_s``. ``local``: the
    container's daemon is known to run here (e.g. a sibling's cgroup was found), so a
    missing cgroup is a dead container's, removed."""
    pids = procs(container_id)
    if pids is None:
        return True if local and control_file(container_id) is None else None
    if not pids:
        return True
    if is_frozen(container_id) and not thaw(container_id):
        return False
    init = _namespace_init(pids)
    for pid in [init] if init is not None else pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue  # gone already
        try:
            if pid in (procs(container_id) or ()):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)
    deadline = time.monotonic() + wait_s
    while (left := procs(container_id)) != []:
        if left is None or time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True
