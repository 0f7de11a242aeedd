"""Engine fixtures: real arena and worker processes on loopback, torn down by pid."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from belayer_engine.common.net import free_port

REPO = Path(__file__).resolve().parents[2]


def poll(predicate, timeout: float, what: str, interval: float = 0.02):
    """Bounded polling: return the first truthy value of predicate() or fail naming `what`."""
    deadline, last_exc = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the thing polled is not up yet
            last_exc = exc
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def terminate(p: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s; reaped either way."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


class Proc:
    """A child process we started; stopped by its own pid only."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log = log
        self.fh = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.p = subprocess.Popen([sys.executable, *args], cwd=REPO, env={**_env(), **(env or {})},
                                  stdout=self.fh, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill9(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(timeout=10)

    def stop(self) -> None:
        terminate(self.p)
        self.fh.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Arena(Proc):
    def __init__(self, tmp: Path, *extra: str, env: dict | None = None, module: str = "belayer_engine.arena"):
        """``module``: the arena program (``belayer_engine.backends.sglang.arena`` adds SGLang's exports)."""
        self.socket = str(tmp / "arena.sock")
        super().__init__(["-m", module, "--socket", self.socket, *extra],
                         tmp / "arena.log", env)
        from belayer_engine.arena.client import ArenaClient

        self.client = ArenaClient(self.socket)
        poll(lambda: self.alive() and self.client.describe(), 60,
             f"arena to answer; log:\n{self.output()}" if not self.alive() else "arena")


class Worker(Proc):
    def __init__(self, arena: Arena, tmp: Path, *extra: str, name: str = "w", launcher: tuple[str, ...] = ()):
        """``launcher``: interpreter arguments before ``-m`` (e.g. ``-c CODE`` that execs the worker)."""
        self.port = free_port()
        super().__init__([*launcher, "-m", "belayer_engine.backends.reference.worker", "--arena-socket", arena.socket,
                          "--port", str(self.port), "--worker-id", name, *extra],
                         tmp / f"worker-{name}-{self.port}.log")
        poll(lambda: self._state_or_dead(), 60, f"worker {name} to answer /belayer/state")

    def _state_or_dead(self):
        if not self.alive():
            pytest.fail(f"worker exited early:\n{self.output()}")
        return self.get("/belayer/state")[0] == 200

    def request(self, method: str, path: str, body=None, raw: bytes | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body))
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode()
            try:
                return resp.status, json.loads(text)
            except json.JSONDecodeError:
                return resp.status, text
        finally:
            conn.close()

    def get(self, path: str):
        return self.request("GET", path)

    def post(self, path: str, body=None, raw: bytes | None = None):
        return self.request("POST", path, body, raw)

    def generate(self, ids: list[int], max_new: int = 16, **params) -> dict:
        params = {"max_new_tokens": max_new, "temperature": 0.0, **params}
        status, out = self.post("/generate", {"input_ids": ids, "sampling_params": params})
        assert status == 200, out
        return out

    def stream(self, body: dict) -> list:
        """All SSE data payloads of a streamed /generate ('[DONE]' kept as a string)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("POST", "/generate", body=json.dumps({**body, "stream": True}))
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            events = []
            for line in resp.read().decode().split("\n"):
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
            return events
        finally:
            conn.close()


@pytest.fixture
def procs():
    """Collects started processes and stops them (by pid) at the end of the test."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


@pytest.fixture(scope="module")
def shared_arena(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("arena")
    arena = Arena(tmp)
    yield arena, tmp
    arena.stop()


@pytest.fixture(scope="module")
def shared_worker(shared_arena):
    arena, tmp = shared_arena
    worker = Worker(arena, tmp, name="shared")
    yield worker
    worker.stop()
