"""Processes of a worker's group other than the one the supervisor spawned: which they are,
and waiting for one to exit (a pidfd: they are not the supervisor's children)."""

from __future__ import annotations

import asyncio
import os


def group_members(pgid: int) -> dict[int, str]:
    """The processes of process group ``pgid`` but its leader: pid -> title (argv[0], which
    a process may have renamed itself, as SGLang's ``sglang::scheduler_TP0``)."""
    out = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) == pgid:
                continue
            pid = int(entry.name)
            try:
                if os.getpgid(pid) != pgid:
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    title = fh.read().split(b"\0", 1)[0].decode(errors="replace")
            except OSError:  # gone meanwhile (ProcessLookupError is one)
                continue
            out[pid] = title
    return out


async def wait_exit(pid: int) -> None:
    """Return once process ``pid`` (any process, not only a child: through a pidfd) exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    loop.add_reader(fd, exited.set)
    try:
        await exited.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)
