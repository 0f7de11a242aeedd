"""What a thread does in the kernel's view (``kv_hooks/belayer_kv_threadstate.py``): the
sampler behind the HTTP loop's stall line tells C code running on a CPU from a wait in a
system call."""

from __future__ import annotations

import hashlib
import mmap
import sys
import threading
import time
from collections import Counter
from pathlib import Path

HOOKS = Path(__file__).resolve().parents[4] / "belayer_engine" / "backends" / "sglang" / "kv_hooks"
sys.path.insert(0, str(HOOKS))
import belayer_kv_threadstate as threadstate  # noqa: E402

CHUNK = b"x" * (8 << 20)  # hashlib releases the GIL for buffers this large: C code on a CPU


def _sampled(work) -> threadstate.ThreadSampler:
    """Sample a thread running ``work`` from before it starts until it ends."""
    started, go = threading.Event(), threading.Event()
    tid: list[int] = []

    def run() -> None:
        tid.append(threading.get_native_id())
        started.set()
        go.wait()
        work()

    thread = threading.Thread(target=run)
    thread.start()
    started.wait()
    sampler = threadstate.ThreadSampler(tid[0], for_s=0.3).start()
    go.set()
    thread.join()
    sampler.join()
    return sampler


def test_c_code_on_a_cpu_reads_as_running_with_its_cpu_time():
    def hash_for_a_while() -> None:
        for _ in range(20):
            hashlib.sha256(CHUNK).digest()

    samples = _sampled(hash_for_a_while).samples
    running = [s for s in samples if s[1] == "R"]
    assert running, samples[:5]
    assert running[-1][2] > running[0][2]  # its time on a CPU grew while it ran


def test_a_wait_in_a_system_call_reads_as_asleep_in_that_call():
    sampler = _sampled(lambda: time.sleep(0.2))
    asleep = Counter(s[4] for s in sampler.samples if s[1] == "S")  # the first may still be its wake-up (futex)
    assert asleep and asleep.most_common(1)[0][0] == "clock_nanosleep", asleep
    line = sampler.summary(0.0, 0.3)
    assert "S/clock_nanosleep" in line and "samples" in line


def test_a_thread_that_is_gone_ends_the_sampling_and_an_empty_window_says_so():
    sampler = _sampled(lambda: None)
    assert sampler.summary(5.0, 6.0).startswith("no samples")


def test_a_window_the_sampler_could_not_run_through_shows_as_its_gap():
    """The gap counts from the sample before the window to the one after it: a whole process
    without a CPU (or the GIL held) for the stall leaves the sampler one long gap."""
    sampler = threadstate.ThreadSampler(1, for_s=0.2)
    sampler.samples = [(t, "S", 0, 0, "epoll_pwait", 0, 0, 0) for t in (0.000, 0.001, 0.100, 0.101)]
    assert sampler.summary(0.010, 0.050) == "no samples; the sampler's longest gap 99.0 ms"
    assert sampler.summary(0.090, 0.102).endswith("the sampler's longest gap 99.0 ms")
    assert sampler.summary(0.0, 0.001).endswith("the sampler's longest gap 99.0 ms")  # up to the next one


def test_fresh_memory_touched_shows_as_the_threads_page_faults():
    """The kernel's work for a thread on a CPU (faulting in memory) is told from user code by
    its page faults: one per 4 KiB page of a fresh anonymous mapping it writes."""
    pages = 4096
    started, go, done, hold = (threading.Event() for _ in range(4))
    tid: list[int] = []

    def touch_fresh_pages() -> None:
        tid.append(threading.get_native_id())
        started.set()
        go.wait()
        with mmap.mmap(-1, pages * mmap.PAGESIZE) as region:
            for page in range(pages):
                region[page * mmap.PAGESIZE] = 1
        done.set()
        hold.wait()  # alive until sampled after the work

    thread = threading.Thread(target=touch_fresh_pages)
    thread.start()
    started.wait()
    sampler = threadstate.ThreadSampler(tid[0], for_s=30).start()
    while not sampler.samples:  # a sample before the work
        time.sleep(0.001)
    go.set()
    done.wait()
    after = len(sampler.samples)
    while len(sampler.samples) <= after:  # and one after it
        time.sleep(0.001)
    hold.set()
    thread.join()
    line = sampler.summary(0.0, sampler.samples[-1][0])
    minor = int(line.split("page faults ")[1].split(" minor")[0])
    assert minor >= pages, line
