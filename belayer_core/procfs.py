"""The one reader of ``/proc/PID/stat``, of ``/proc/self/mounts``, and the one owner-liveness
rule (torch-free core).

Anything Belayer leaves behind for a later reaper (containers, staging directories, shared
memory files) names its owner as an ``OwnerId``: (pid, process start time). A pid alone is
unsafe: after the owner dies the kernel may hand its pid to an unrelated process, which
would then seem to own the leftovers forever. The start time (clock ticks since boot,
field 22 of ``/proc/PID/stat``) tells the two apart.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

PF_EXITING = 0x4
"""``flags`` bit of a task in do_exit (e.g. an init killed while frozen, waiting for its namespace)."""


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` Belayer uses."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    flags: int
    start_time: int
    """Clock ticks after boot at which the process started."""

    @property
    def running(self) -> bool:
        """Neither a zombie, dead, nor on its way out."""
        return self.state not in "ZX" and not self.flags & PF_EXITING


def read_stat(pid: int) -> ProcStat | None:
    """``/proc/PID/stat`` parsed, or None when no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            text = f.read()
    except (OSError, ValueError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    head, _, tail = text.rpartition(")")
    fields = tail.split()
    try:
        return ProcStat(pid=int(pid), comm=head.partition("(")[2], state=fields[0], ppid=int(fields[1]),
                        pgrp=int(fields[2]), session=int(fields[3]), flags=int(fields[6]),
                        start_time=int(fields[19]))
    except (IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None when it does not exist."""
    stat = read_stat(pid)
    return None if stat is None else stat.start_time


def processes() -> list[ProcStat]:
    """Every process visible in ``/proc`` (ones that exit while being read are skipped)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := read_stat(int(entry))) is not None:
            out.append(stat)
    return out


def session_members(sid: int, *, live: bool = False) -> list[int]:
    """Pids of every process of session ``sid``; with ``live``, only those still ``running``."""
    return [p.pid for p in processes() if p.session == sid and (p.running or not live)]


_CURRENT: dict[int, OwnerId] = {}  # ``OwnerId.current`` (read from /proc once, not per temp dir named)


@dataclass(frozen=True)
class OwnerId:
    """A process, named so that pid reuse cannot impersonate it."""

    pid: int
    start_time: int

    @classmethod
    def current(cls) -> OwnerId:
        pid = os.getpid()  # remembered per pid: a forked child is another owner
        if (known := _CURRENT.get(pid)) is None:
            known = _CURRENT.setdefault(pid, cls(pid, process_start_time(pid) or 0))
        return known

    def alive(self) -> bool:
        """True while this very process (same pid *and* start time) exists."""
        return process_start_time(self.pid) == self.start_time

    def to_label(self) -> str:
        """``<pid>-<start ticks>``: safe in file names and Docker labels."""
        return f"{self.pid}-{self.start_time}"

    @classmethod
    def from_label(cls, label: str) -> OwnerId | None:
        """Parse ``to_label``'s text; None when it is not one."""
        pid, sep, start = label.partition("-")
        if not sep or not pid.isdigit() or not start.isdigit():
            return None
        return cls(int(pid), int(start))


def owner_alive(label: str) -> bool:
    """The rule for a leftover named by ``OwnerId.to_label()``: kept while its owner runs.

    Text that names no owner counts as dead (nothing would ever reap it otherwise).
    """
    owner = OwnerId.from_label(label)
    return owner is not None and owner.alive()


@dataclass(frozen=True)
class Mount:
    """One line of ``/proc/self/mounts`` (octal escapes such as ``\\040`` decoded)."""

    source: str
    target: str
    fstype: str
    options: str


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def mounts() -> list[Mount]:
    """This process's mount table, in mount order (a later one over an earlier one at the
    same target hides it)."""
    out = []
    for line in _lines("/proc/self/mounts"):
        fields = line.split()
        if len(fields) >= 4:
            out.append(Mount(*(_unescape(x) for x in fields[:4])))
    return out


@dataclass(frozen=True)
class MountRoot:
    """One line of ``/proc/self/mountinfo``, for what ``Mount`` lacks: ``root``, the subtree
    of its file system a mount shows (``/`` unless it is a bind mount of a part)."""

    root: str
    target: str
    fstype: str
    super_options: str


def mount_roots() -> list[MountRoot]:
    """This process's ``/proc/self/mountinfo``, in mount order."""
    out = []
    for line in _lines("/proc/self/mountinfo"):
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and len(tail) >= 3:
            out.append(MountRoot(_unescape(fields[3]), _unescape(fields[4]), tail[0], tail[2]))
    return out


def mount_of(path: str) -> Mount | None:
    """The mount that ``path`` (absolute, symlinks resolved by the caller) is on: the one
    with the longest target containing it, the topmost at that target."""
    best: Mount | None = None
    for m in mounts():
        inside = path == m.target or path.startswith(m.target.rstrip("/") + "/")
        if inside and (best is None or len(m.target) >= len(best.target)):
            best = m
    return best
