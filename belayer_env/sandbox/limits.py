"""A sandbox's own limits, read from its cgroup on the host: how often its processes hit the
memory and pids limits, and how many process slots are in use.

Hitting a limit is the agent's outcome (its command's error text and exit code, with a
``[belayer: ...]`` note), never an infrastructure failure: these counters are the evidence that
tells "could not fork, the sandbox's own processes hold every slot" from "the container died".
"""

from __future__ import annotations

from typing import NamedTuple


class Hits(NamedTuple):
    """Counters of a sandbox's cgroup, 0 when unreadable (a remote daemon)."""

    oom: int
    """Processes killed by the OOM killer at the memory limit."""
    pids: int
    """Forks refused at the pids limit."""


def _paths(container_id: str, controller: str, filename: str) -> tuple[str, ...]:
    cid = container_id
    return (f"/sys/fs/cgroup/{controller}/docker/{cid}/{filename}",  # v1, cgroupfs driver
            f"/sys/fs/cgroup/{controller}/system.slice/docker-{cid}.scope/{filename}",  # v1, systemd driver
            f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/{filename}",  # v2, systemd driver
            f"/sys/fs/cgroup/docker/{cid}/{filename}")  # v2, cgroupfs driver


def counter(container_id: str, controller: str, filename: str, key: str) -> int:
    """A ``key value`` counter from the container's cgroup (v1 or v2); 0 when unreadable."""
    for path in _paths(container_id, controller, filename):
        try:
            with open(path) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == key:
                        return int(v)
        except (OSError, ValueError):
            continue
    return 0


def hits(container_id: str) -> Hits:
    """(OOM kills, fork refusals at the pids limit) so far."""
    oom = counter(container_id, "memory", "memory.oom_control", "oom_kill") or \
        counter(container_id, "memory", "memory.events", "oom_kill")
    return Hits(oom, counter(container_id, "pids", "pids.events", "max"))


def _value(container_id: str, controller: str, filename: str) -> str | None:
    for path in _paths(container_id, controller, filename):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            continue
    return None


def pids_in_use(container_id: str) -> int | None:
    """Processes (tasks) of the sandbox now; None when unreadable."""
    value = _value(container_id, "pids", "pids.current")
    return int(value) if value and value.isdigit() else None


def pids(container_id: str) -> tuple[int, int] | None:
    """(the pids limit, processes in use) now; None when unknown or unlimited. Read on the
    host: inside a restored sandbox the cgroup files are not where they were."""
    limit, used = _value(container_id, "pids", "pids.max"), pids_in_use(container_id)
    if used is None or not limit or not limit.isdigit():
        return None
    return int(limit), used


def notes(before: Hits, after: Hits, memory: str, pids_limit: int) -> str:
    """What the agent is told about limits its command hit (empty when none)."""
    out = ""
    if after.oom > before.oom:
        out += f"\n[belayer: a process was killed for exceeding the memory limit ({memory})]"
    if after.pids > before.pids:
        out += f"\n[belayer: process creation failed at the sandbox's limit of {pids_limit} processes]"
    return out
