"""The memory hog behind the ``oom`` fault, run from the host: ``python -I -S oom_hog.py PID PROCS...``.

``PID`` is the container's init (host pid), ``PROCS`` the ``cgroup.procs`` files of the
container's cgroups (v1: memory and freezer; v2: its one cgroup). Children fork one at a
time, each joins those cgroups and holds 32 MiB, until the kernel's OOM killer takes the
init (the caller raised its oom_score_adj to 1000); then the children are killed and the
hog exits. Each child must stay small: the kernel scores the init at its pages + 1000 *
(limit pages // 1000), a little under the limit, so one child holding nearly the limit
would be the one killed. The first line on stdout says whether the first child joined
(``joined``) or could not (``failed: ...``: the caller falls back to ``docker exec``).

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
    for path in procs:  # one byte per cgroup joined: the parent never lets a child hog the host
        with open(path, "w") as f:
            f.write(str(os.getpid()))  # joining a frozen sandbox's freezer cgroup freezes it here
        os.write(report, b"j")
    held = bytearray(b"x") * CHILD_BYTES  # noqa: F841 - holding it is the point
    os.write(report, b"h")
    select.select([init_died], [], [], LIFETIME_S)
    os._exit(0)


def _joined(report: int, init_died: int, expected: int, deadline: float) -> bool:
    """Whether the child joined all ``expected`` cgroups (False: a join failed and it exited).

    Read until it holds its share or died taking it (the OOM killer may pick a child); True
    as well once the init died or time is up: the caller's loop then ends the hog."""
    heard = b""
    while b"h" not in heard:
        readable = select.select([report, init_died], [], [], max(0.0, deadline - time.monotonic()))[0]
        if report not in readable:
            return True
        chunk = os.read(report, expected + 1)
        if not chunk:
            break
        heard += chunk
    return heard.count(b"j") >= expected


class _Caller:
    """The caller's end of stdout: told once whether the first child joined the sandbox's
    cgroups (fd 1 stays open: closed, a later pipe could take its number)."""

    def __init__(self) -> None:
        self.told = False

    def tell(self, message: bytes) -> None:
        if not self.told:
            self.told = True
            try:
                os.write(1, message)
            except OSError:  # the caller stopped listening
                pass


def main(init_pid: int, procs: list[str]) -> None:
    caller = _Caller()
    try:
        init_died = os.pidfd_open(init_pid)
    except ProcessLookupError:
        caller.tell(b"failed: the init is gone\n")
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
            joined = _joined(report, init_died, len(procs), deadline)
            os.close(report)
            if not joined:
                caller.tell(b"failed: a child could not join the sandbox's cgroups\n")
                return  # never hog the host's memory
            if len(children) == 1:
                caller.tell(b"joined\n")
        select.select([init_died], [], [], max(0.0, deadline - time.monotonic()))
    finally:
        caller.tell(b"ended\n")
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for child in children:
            os.waitpid(child, 0)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
