"""Real SGLang servers behind the engine. One engine per module: a server takes about a
minute to start on a loaded 2-core machine.

SGLang lives in its own venv (``scripts/setup_sglang.sh``, run by ``scripts/setup.sh``):
a missing venv fails these tests, never skips them (the README's test command installs it).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from belayer_engine.backends.sglang.launcher import DEFAULT_VENV, SETUP_HINT


def sglang_venv() -> str:
    venv = os.environ.get("BELAYER_SGLANG_VENV") or DEFAULT_VENV
    if (Path(venv) / "bin" / "python").is_file():
        return venv
    pytest.fail(f"SGLang is not installed at {venv}: {SETUP_HINT}")


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
                self.at_hold = {"tokens": dict(self._seen), "after_s": round(time.monotonic() - self.since, 3)}
                self.held.set()

    def wait(self, what: str, timeout: float = 600.0) -> None:
        assert self.held.wait(timeout), f"{what} before the fault"
