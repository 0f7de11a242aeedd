"""What a thread does in the kernel's view while its event loop stalls: a sampler on a thread
of its own (log lines only).

After one promotion on an H100 the shadow's HTTP loop stalled 26 ms before any re-sent
request reached SGLang's app, and py-spy saw no Python running in it. The kernel tells the
cases apart: running on a CPU (state R, its CPU time growing: C code), runnable but waiting
for a CPU (its run-queue wait growing: the machine's cores are busy), asleep in a system call
(S, with the call: waiting), or in uninterruptible sleep (D: a page fault, a lock in the
kernel). On a CPU, its page faults and its CPU time in the kernel (10 ms ticks) tell user
code from the kernel's work for it (faulting in fresh memory, compacting it). A second run
on the H100 found the thread on a CPU holding the GIL for 21-28 ms. Reading /proc costs
~45 us per sample on the CPU VM (~4% of a core at 1 kHz, for 300 ms per adoption); the
sampler holds the GIL only for part of that, and its own gaps say when it could not get it.
Standard library only.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

SYSCALLS = {0: "read", 1: "write", 7: "poll", 23: "select", 202: "futex", 230: "clock_nanosleep", 232: "epoll_wait",
            271: "ppoll", 281: "epoll_pwait", 441: "epoll_pwait2"}  # x86_64: the waits an event loop makes


def read_state(tid: int) -> tuple[str, int, int, str, int, int, int]:
    """(state letter, ns on a CPU, ns waiting for one, current system call, minor and major
    page faults, CPU ticks in the kernel) of thread ``tid`` of this process (from schedstat;
    CPU ticks of 10 ms and no wait where it is missing)."""
    with open(f"/proc/self/task/{tid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()  # fields[0] is stat's 3rd field (state)
    state, minor, major, kernel_ticks = fields[0], int(fields[7]), int(fields[9]), int(fields[12])
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as fh:
            on_cpu, waiting = (int(v) for v in fh.read().split()[:2])
    except (OSError, ValueError):
        on_cpu, waiting = (int(fields[11]) + int(fields[12])) * 10_000_000, 0  # utime + stime, at 100 Hz
    try:
        with open(f"/proc/self/task/{tid}/syscall") as fh:
            call = fh.read().split()[0]
    except (OSError, IndexError):
        call = "?"
    if call.isdigit():
        call = SYSCALLS.get(int(call), call)
    return state, on_cpu, waiting, call, minor, major, kernel_ticks


class ThreadSampler:
    """Samples ``tid`` every ``every_s`` for ``for_s`` from ``start()``; ``summary(a, b)``
    says what it was doing between ``a`` and ``b`` seconds after the start."""

    def __init__(self, tid: int, for_s: float, every_s: float = 0.001):
        self.tid, self.for_s, self.every_s = tid, for_s, every_s
        self.samples: list[tuple[float, str, int, int, str, int, int, int]] = []
        self.t0 = 0.0
        self._thread = threading.Thread(target=self._run, name="belayer-thread-sampler", daemon=True)

    def start(self) -> ThreadSampler:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while (now := time.perf_counter()) - self.t0 < self.for_s:
            try:
                self.samples.append((now - self.t0, *read_state(self.tid)))
            except OSError:  # the thread is gone
                return
            time.sleep(self.every_s)

    def summary(self, since_s: float, until_s: float) -> str:
        """Counts of (state, system call) between the two times, the thread's time on a CPU and
        waiting for one from the sample before them to the one after, and the sampler's longest
        gap there (it too needs a CPU and the GIL)."""
        inside = [s for s in self.samples if since_s <= s[0] <= until_s]
        # from the sample before the window to the one after it: a sampler that could not run
        # through the window (no CPU for this process, or the GIL held) shows as one long gap
        around = [s for s in self.samples if s[0] < since_s][-1:] + inside + \
            [s for s in self.samples if s[0] > until_s][:1]
        gap = max((b[0] - a[0] for a, b in zip(around, around[1:], strict=False)), default=0.0)
        if not inside:
            return f"no samples; the sampler's longest gap {1e3 * gap:.1f} ms"
        states = Counter(f"{s[1]}/{s[4]}" if s[1] != "R" else "R" for s in inside)
        span = around[-1][0] - around[0][0]
        on_cpu, waiting, minor, major, kernel = (around[-1][i] - around[0][i] for i in (2, 3, 5, 6, 7))
        return (f"{len(inside)} samples: " + ", ".join(f"{k} {v}" for k, v in states.most_common()) +
                f"; of the {1e3 * span:.1f} ms sampled around it, on a CPU {on_cpu / 1e6:.1f} ms (in the kernel "
                f"{10 * kernel} ms, 10 ms ticks), waiting for one {waiting / 1e6:.1f} ms; page faults {minor} minor, "
                f"{major} major; the sampler's longest gap {1e3 * gap:.1f} ms")
