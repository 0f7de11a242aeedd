"""Children that never outlive their engine: owner identity, death signal, watchdog.

The engine passes its identity (``pid:start_time`` from ``/proc``, so a recycled pid is
never mistaken for it) to the arena, workers and shadows in ``BELAYER_OWNER``. Each child
calls ``watch_owner`` at start: the kernel sends it a signal when its parent dies
(``PR_SET_PDEATHSIG``, covers SIGKILL of the engine), and a small thread checks the
owner's identity every second (covers what the death signal misses: an owner that died
before the child set it up, or a child started by another thread). ``belayer gc`` uses
``orphans()`` to find engine processes whose owner is gone. Torch-free, Linux only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

ENV = "BELAYER_OWNER"
_PR_SET_PDEATHSIG = 1


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def identity(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_time(pid)}"


def alive(owner: str) -> bool:
    """True while the process named by ``identity()`` output still runs (same pid, same start)."""
    try:
        pid, started = owner.split(":")
        return str(start_time(int(pid))) == started
    except ValueError:
        return False


def env_for_children() -> dict[str, str]:
    return {ENV: identity()}


def watch_owner(on_death: Callable[[], None], death_signal: int = signal.SIGTERM, interval_s: float = 1.0) -> str | None:
    """Arrange for ``on_death()`` (or ``death_signal``) once the owner is gone; the owner, or
    None when this process was started without one (standalone: nothing to watch)."""
    owner = os.environ.get(ENV)
    if not owner:
        return None
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watchdog thread alone
    if not alive(owner):  # died before the death signal was armed
        on_death()
        return owner

    def loop() -> None:
        while alive(owner):
            time.sleep(interval_s)
        on_death()

    threading.Thread(target=loop, name="owner-watch", daemon=True).start()
    return owner


def orphans() -> list[tuple[int, str]]:
    """(pid, owner) of every process started with ``BELAYER_OWNER`` whose owner is gone."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue  # another user's process, or gone
        for item in env.split(b"\0"):
            if item.startswith(ENV.encode() + b"="):
                owner = item.split(b"=", 1)[1].decode(errors="replace")
                if not alive(owner):
                    out.append((int(d.name), owner))
                break
    return sorted(out)
