"""The processes a dump starts (runc, CRIU, the action scripts, an orphan-thaw watcher), marked
so that what a dead checkpointer left can be found and ended (``belayer gc``).

Every dump runs runc with ``MARKER=<pid>-<start ticks>`` of the checkpointer (its
``OwnerId``) in its environment, which CRIU, its action scripts and their helpers inherit,
plus the container dumped and, when the checkpointer froze the cgroup itself, the freezer
control file and its thawed value. ``orphans()`` lists the marked processes whose
checkpointer is gone; ``end()`` kills them and thaws what their dumps had frozen.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from dataclasses import dataclass
from pathlib import Path

from belayer_core.procfs import OwnerId, owner_alive, process_start_time, processes

MARKER = "BELAYER_CHECKPOINTER"
CONTAINER = "BELAYER_CHECKPOINT_OF"
THAW = "BELAYER_CHECKPOINT_THAW"
"""``<freezer control file>=<thawed value>``: what to write once the dump's processes are ended."""
END_WAIT_S = 5.0


def marker_env(container_id: str, orphan_thaw: tuple[Path, str] | None = None) -> dict[str, str]:
    """The environment entries that mark a dump's processes as this process's helpers."""
    env = {MARKER: OwnerId.current().to_label(), CONTAINER: container_id}
    if orphan_thaw is not None:
        env[THAW] = f"{orphan_thaw[0]}={orphan_thaw[1]}"
    return env


@dataclass(frozen=True)
class Helper:
    pid: int
    comm: str
    owner: str
    """The checkpointer's ``OwnerId`` label."""
    container: str
    thaw: str | None
    start_time: int = 0
    """With ``pid``, this very process (``end`` re-checks it once it holds a pidfd)."""


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in (MARKER.encode(), CONTAINER.encode(), THAW.encode()):
            env[key.decode()] = value.decode(errors="replace")
    return env


def marked() -> list[Helper]:
    """Every running process of a dump: those that carry its marker, and the other members of
    their sessions (each dump runs in a session of its own, runc its leader; CRIU overwrites
    its environment with its process title, so it is found this way)."""
    running = [st for st in processes() if st.pid != os.getpid() and st.running]
    found: dict[int, Helper] = {}
    sessions: dict[int, Helper] = {}
    for st in running:
        env = _environ(st.pid)
        if env and MARKER in env:
            found[st.pid] = Helper(st.pid, st.comm, env[MARKER], env.get(CONTAINER, ""), env.get(THAW), st.start_time)
            sessions.setdefault(st.session, found[st.pid])
    for st in running:
        if st.pid not in found and (of := sessions.get(st.session)) is not None:
            found[st.pid] = Helper(st.pid, st.comm, of.owner, of.container, of.thaw, st.start_time)
    return list(found.values())


def orphans() -> list[Helper]:
    """The processes of dumps whose checkpointer is no longer running."""
    return [h for h in marked() if not owner_alive(h.owner)]


def end(helpers: list[Helper]) -> list[int]:
    """SIGKILL ``helpers`` (CRIU first: its tracees are released as it dies), then write each
    dump's thawed value to its freezer (nothing else would thaw a cgroup the dead
    checkpointer froze). Returns the pids signalled."""
    ended, held = [], []
    for h in sorted(helpers, key=lambda h: h.comm != "criu"):
        try:  # by a pidfd, taken while the pid still carries the same marker: never a reused pid
            fd = os.pidfd_open(h.pid)
        except OSError:
            continue
        held.append(fd)
        if process_start_time(h.pid) != h.start_time:  # another process by now
            continue
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            ended.append(h.pid)
    for fd in held:  # gone before their freezer is thawed
        select.select([fd], [], [], END_WAIT_S)
        os.close(fd)
    for spec in {h.thaw for h in helpers if h.thaw}:
        path, _, value = spec.rpartition("=")
        if path.startswith("/sys/fs/cgroup/") and value in ("THAWED", "0"):
            with contextlib.suppress(OSError), open(path, "w") as f:
                f.write(value)
    return ended
