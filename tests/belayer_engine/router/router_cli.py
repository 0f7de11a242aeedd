"""The router CLI as a user runs it (``belayer serve router --worker URL ... --json``), for
tests that put real workers behind it."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import urllib.request

import pytest

from tests.belayer_engine.conftest import REPO, Worker, _env, poll, terminate


class RouterCLI:
    """``python3 -m belayer serve router --worker URL ... --json`` as a user runs it."""

    def __init__(self, urls: list[str], log_path, ready_timeout: float = 60.0):
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        workers = [arg for url in urls for arg in ("--worker", url)]
        self.p = subprocess.Popen(
            [sys.executable, "-m", "belayer", "serve", "router", *workers, "--port", "0", "--json"],
            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=self.log)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.p.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=ready_timeout)
        except queue.Empty:
            self.stop()
            pytest.fail(f"router printed no JSON line within {ready_timeout}s; log:\n{self._output()}")
        if not line:
            self.stop()
            pytest.fail(f"router exited (rc={self.p.poll()}) before printing its endpoint; log:\n{self._output()}")
        try:
            self.base_url = json.loads(line)["base_url"]
        except (ValueError, KeyError):
            self.stop()
            pytest.fail(f"router's first stdout line is not the documented JSON: {line!r}")
        self.root = self.base_url.removesuffix("/v1")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.root + path, timeout=10) as resp:
            return json.loads(resp.read())

    def live_slots(self) -> dict[str, dict]:
        return {slot: ep for slot, ep in self.get("/belayer/workers")["slots"].items() if ep is not None}

    def stop(self) -> None:
        terminate(self.p)
        self.p.stdout.close()
        self.log.close()

    def _output(self) -> str:
        return self.log_path.read_text(errors="replace")


def _url(worker: Worker) -> str:
    return f"http://127.0.0.1:{worker.port}"


def _wait_live(router: RouterCLI, n: int, timeout: float = 30.0) -> dict[str, dict]:
    """Bounded wait until the router's own /health probing has ``n`` live workers."""
    def live():
        slots = router.live_slots()
        return slots if len(slots) == n else None

    return poll(live, timeout, f"the router to see {n} live worker(s)")
