"""Real SGLang servers behind the engine. One engine per module: a server takes about a
minute to start on a loaded 2-core machine.

SGLang lives in its own venv (``scripts/setup_sglang.sh``, run by ``scripts/setup.sh``):
a missing venv fails these tests, never skips them (the README's test command installs it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from functools import partial
from pathlib import Path

import pytest

from belayer_core import procfs
from belayer_engine.backends.sglang.launcher import DEFAULT_VENV, SETUP_HINT


def sglang_venv() -> str:
    venv = os.environ.get("BELAYER_SGLANG_VENV") or DEFAULT_VENV
    if (Path(venv) / "bin" / "python").is_file():
        return venv
    pytest.fail(f"SGLang is not installed at {venv}: {SETUP_HINT}")


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's CPU controller (this project's hosts)
CPU_PERIOD_US = 100_000


def _cap_cpu(pgid: int, share: float) -> bool:
    """Put every process of group ``pgid`` in a CPU cgroup capped at ``share`` of one core
    (its children inherit it); False where no such cgroup can be made (no cgroup v1 CPU
    controller, not root): the pacing alone then."""
    group = CPU_CGROUP / f"belayer-test-hold-{os.getpid()}-{pgid}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, int(CPU_PERIOD_US * share))))
        for proc in procfs.processes():
            if proc.pgrp == pgid:
                with contextlib.suppress(OSError):  # gone meanwhile
                    (group / "cgroup.procs").write_text(str(proc.pid))
    except OSError:
        return False
    atexit.register(_remove_cgroup, group)
    return True


def _remove_cgroup(group: Path) -> None:
    """At exit: the held servers were killed by then; anything left goes back to the root."""
    with contextlib.suppress(OSError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_CGROUP / "cgroup.procs").write_text(pid)
        group.rmdir()


class HoldServer:
    """Runs the serving SGLang server's process group in short slices (SIGCONT, a few ms,
    SIGSTOP) until the stream reader that completes the set of started streams stops it for
    good, at that chunk: the fault that follows lands while the streams are mid-generation,
    however late this process's readers run. Unpaced, two CI runs saw the server end every
    48-token stream before its reader had four tokens, and a rehearsal with 256-token streams
    and the server at nice 19 did too (stream readers and router share this process's one
    interpreter lock while the server decodes on the other core)."""

    RUN_S, PAUSE_S = 0.005, 0.095  # pacing, not synchronisation: the server gets a few % of a core

    def __init__(self, engine, streams: int):
        self._pgid = os.getpgid(engine.worker_pid(0))
        self._streams, self._seen, self._lock = streams, {}, threading.Lock()
        self.held = threading.Event()
        self.since, self.at_hold = time.monotonic(), None  # what the failure texts report
        os.killpg(self._pgid, signal.SIGSTOP)
        # The slices above stretch when this process is descheduled (a loaded machine let a
        # server finish 200 ids before its readers saw 8): the kernel caps the group too.
        self.capped = _cap_cpu(self._pgid, self.RUN_S / (self.RUN_S + self.PAUSE_S))
        threading.Thread(target=self._pace, name="pace-sglang", daemon=True).start()

    def _pace(self) -> None:
        try:
            while not self.held.is_set():
                with self._lock:
                    if self.held.is_set():
                        return
                    os.killpg(self._pgid, signal.SIGCONT)
                time.sleep(self.RUN_S)
                with self._lock:
                    os.killpg(self._pgid, signal.SIGSTOP)
                self.held.wait(self.PAUSE_S)
        except ProcessLookupError:  # the group is gone: nothing left to pace
            return

    def started(self, stream: int, tokens: int) -> None:
        with self._lock:
            self._seen[stream] = tokens
            if len(self._seen) == self._streams and not self.held.is_set():
                os.killpg(self._pgid, signal.SIGSTOP)  # a SIGKILL or a cold restart ends it
                self.at_hold = {"tokens": dict(self._seen), "after_s": round(time.monotonic() - self.since, 3),
                                "cpu_capped": self.capped}
                self.held.set()

    def wait(self, what: str, timeout: float = 600.0) -> None:
        assert self.held.wait(timeout), f"{what} before the fault"


def streams_across(engine, streams: list, fault, timeout: float = 600.0) -> tuple[list[dict], dict]:
    """Run ``streams`` (each ``stream(on_tokens, out)``: a client that fills ``out`` and calls
    ``on_tokens(n)`` as ids arrive) in threads against ``engine``, hold the serving server
    once every stream has tokens (``HoldServer``), then ``fault()``; returns each stream's
    ``out`` once all finished, and where the hold caught them (for failure texts)."""
    hold = HoldServer(engine, len(streams))
    results = [{} for _ in streams]
    threads = [threading.Thread(target=stream, args=(partial(hold.started, i), results[i]))
               for i, stream in enumerate(streams)]
    for t in threads:
        t.start()
    hold.wait("every stream delivered tokens")
    fault()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"every stream finished after the fault (held at {hold.at_hold})"
    return results, hold.at_hold
