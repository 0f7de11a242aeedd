"""Children that never outlive their engine: owner identity, death signal, watchdog.

The engine passes its identity (``belayer_core.procfs.OwnerId``: pid and start time, so a
recycled pid is never mistaken for it) to the arena, workers and shadows in
``BELAYER_OWNER``. Each child calls ``watch_owner`` at start: the kernel sends it a signal when its parent dies
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

from belayer_core.procfs import OwnerId, owner_alive

ENV = "BELAYER_OWNER"
_PR_SET_PDEATHSIG = 1


def env_for_children() -> dict[str, str]:
    return {ENV: OwnerId.current().to_label()}


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
    if not owner_alive(owner):  # died before the death signal was armed
        on_death()
        return owner

    def loop() -> None:
        while owner_alive(owner):
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
                if not owner_alive(owner):
                    out.append((int(d.name), owner))
                break
    return sorted(out)
