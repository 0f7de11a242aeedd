"""The memory hog behind the ``oom`` fault, run from the host: ``python -I -S oom_hog.py PID PROCS...``.

``PID`` is the container's init (host pid), ``PROCS`` the ``cgroup.procs`` files of the
container's cgroup-v1 freezer and memory controllers. Children fork one at a time, each
joins those cgroups and holds 32 MiB, until the kernel's OOM killer takes the init (the
caller raised its oom_score_adj to 1000); then the children are killed and the hog exits.
Each child must stay small: the kernel scores the init at its pages + 1000 * (limit pages
// 1000), a little under the limit, so one child holding nearly the limit would be the one
killed.

Why from the host and not by ``docker exec``: a capture refuses a sandbox running an exec
("running a command"), so an exec'd hog made every capture racing the fault fail, which
memory grown by the sandbox's own processes does not. In the freezer cgroup the hog is
frozen with the sandbox during a capture (it must not fill memory while the sandbox cannot
answer); CRIU dumps the init's tree only, so the hog is never in a checkpoint. Standard
library only, no site: it starts in milliseconds.
"""

import os
import select
import signal
import sys
import time

CHILD_BYTES = 32 << 20
MAX_CHILDREN = 512  # 16 GiB: no container limit above that is ever reached
LIFETIME_S = 60.0


def _child(procs: list[str], init_died: int, report: int) -> None:
    for path in procs:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    os.write(report, b"j")  # joined: from here its memory counts against the container's limit
    held = bytearray(b"x") * CHILD_BYTES  # noqa: F841 - holding it is the point
    os.write(report, b"h")
    select.select([init_died], [], [], LIFETIME_S)
    os._exit(0)


def _read_report(report: int, init_died: int, deadline: float) -> bytes:
    """What the child reported before it held its share, died (the OOM killer may pick a
    child), or the init died."""
    heard = b""
    while len(heard) < 2:
        readable = select.select([report, init_died], [], [], max(0.0, deadline - time.monotonic()))[0]
        if report not in readable:
            return heard or b"j"  # the init died or time is up: the loop's checks end it
        chunk = os.read(report, 2)
        if not chunk:
            return heard
        heard += chunk
    return heard


def main(init_pid: int, procs: list[str]) -> None:
    try:
        init_died = os.pidfd_open(init_pid)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + LIFETIME_S
    children: list[int] = []
    try:
        while len(children) < MAX_CHILDREN and time.monotonic() < deadline:
            if select.select([init_died], [], [], 0)[0]:
                return
            report, report_w = os.pipe()
            child = os.fork()
            if child == 0:
                try:
                    os.close(report)
                    _child(procs, init_died, report_w)
                finally:
                    os._exit(1)
            children.append(child)
            os.close(report_w)
            heard = _read_report(report, init_died, deadline)
            os.close(report)
            if not heard.startswith(b"j"):
                return  # it could not join the container's cgroups: never hog the host's memory
        select.select([init_died], [], [], max(0.0, deadline - time.monotonic()))
    finally:
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in children:
            os.waitpid(child, 0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
