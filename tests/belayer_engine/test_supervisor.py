"""Supervisor paths beyond a plain handover: unhealthy-device exclusion and arena death."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig
from tests.conftest import process_alive

from .test_chaos import PROMPTS, fault_free, run_round

pytestmark = pytest.mark.timeout(300)


def test_repeated_failure_excludes_device_and_requests_move():
    with RecoverableEngine.launch(workers=2, shadow=True, router=RouterConfig(stall_timeout_s=2.0), unhealthy_window_s=60) as eng:
        eng.wait_ready(timeout=180)
        base = fault_free(eng.base_url)
        first = eng.worker_pid(0)
        asyncio.run(run_round(eng.base_url, PROMPTS, 3, lambda: os.kill(first, signal.SIGKILL)))
        eng.wait_ready(timeout=120)
        second = eng.worker_pid(0)
        assert second != first
        # The replacement fails again right away: the device is excluded, its requests move.
        results = asyncio.run(run_round(eng.base_url, PROMPTS, 3, lambda: os.kill(second, signal.SIGKILL)))
        assert [ids for ids, _, _ in results] == [base[p] for p in PROMPTS]
        eng.wait_ready(timeout=60)
        status = eng.status()
        assert status["slots"]["w0"]["excluded"] and not status["slots"]["w1"]["excluded"]
        assert [e for e in status["events"] if e["event"] == "excluded" and e["slot"] == "w0"]
        assert eng.worker_pid(0) is None
        # Everything still works on the healthy device.
        assert fault_free(eng.base_url) == base
        assert all(not process_alive(p) for p in (first, second))


def test_arena_death_cold_restarts_and_requests_wait():
    with RecoverableEngine.launch(workers=1, shadow=True) as eng:
        eng.wait_ready(timeout=120)
        base = fault_free(eng.base_url)
        slot = eng.status()["slots"]["w0"]
        arena, worker = slot["arena_pid"], slot["worker_pid"]
        results = asyncio.run(run_round(eng.base_url, PROMPTS, 5, lambda: os.kill(arena, signal.SIGKILL)))
        assert [ids for ids, _, _ in results] == [base[p] for p in PROMPTS]
        eng.wait_ready(timeout=120)
        slot = eng.status()["slots"]["w0"]
        assert slot["arena_pid"] != arena and slot["worker_pid"] != worker
        assert any(e["event"] == "cold_restart" for e in eng.events())
        assert not process_alive(worker)


def test_last_device_excluded_gives_a_clear_error_not_a_hang():
    import openai

    with RecoverableEngine.launch(workers=1, shadow=True, unhealthy_window_s=60) as eng:
        eng.wait_ready(timeout=120)
        t0 = time.monotonic()
        os.kill(eng.worker_pid(0), signal.SIGKILL)
        assert eng.wait_event("handover", since=t0, timeout=30)["path"] == "shadow"
        os.kill(eng.worker_pid(0), signal.SIGKILL)  # the replacement fails again at once
        eng.wait_event("excluded", since=t0, timeout=30)
        client = openai.OpenAI(base_url=eng.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="DeviceUnhealthy"):
            client.completions.create(model="m", prompt="hi", max_tokens=4)


def test_idle_stalled_worker_is_found_by_health_probes():
    """SIGSTOP with no request in flight: only the supervisor's probes can notice it."""
    with RecoverableEngine.launch(workers=1, shadow=True, health_interval_s=0.2, health_timeout_s=0.5, health_failures=2) as eng:
        eng.wait_ready(timeout=120)
        base = fault_free(eng.base_url)
        pid, t0 = eng.worker_pid(0), time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        detected = eng.wait_event("detected", since=t0, timeout=30)
        assert detected["source"] == "health" and detected["pid"] == pid
        assert eng.wait_event("handover", since=t0, timeout=30)["path"] == "shadow"
        assert not process_alive(pid), "the stopped worker must be fenced (SIGKILL works on stopped processes)"
        assert fault_free(eng.base_url) == base


def _shadow_pids(run_dir: str) -> list[int]:
    """Pids of this engine's shadows (their argv names the run dir's arena socket)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"--shadow" in argv and any(run_dir.encode() in a for a in argv):
            pids.append(int(entry))
    return pids


def test_a_shadow_that_dies_while_starting_is_started_again(tmp_path):
    """A real start failure (the starting shadow SIGKILLed): the slot gets its standby
    anyway, and wait_ready() does not wait for one that will never come."""
    run_dir = str(tmp_path / "run")
    killed: list[int] = []
    stop = threading.Event()

    def kill_the_first_shadow() -> None:  # as soon as it exists, long before it can be ready
        while not stop.is_set() and not killed:
            for pid in _shadow_pids(run_dir):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                break
            stop.wait(0.002)

    killer = threading.Thread(target=kill_the_first_shadow, daemon=True)
    killer.start()
    try:
        with RecoverableEngine.launch(workers=1, shadow=True, run_dir=run_dir) as eng:
            eng.wait_ready(timeout=180)
            stop.set()
            failed = [e for e in eng.events() if e["event"] == "shadow_failed"]
            assert killed and failed, (killed, eng.events())
            assert failed[0]["attempt"] == 1 and failed[0]["retry"] is True, failed
            shadow = eng.status()["slots"]["w0"]["shadow_pid"]
            assert shadow is not None and shadow not in killed
            assert not process_alive(killed[0])
            assert fault_free(eng.base_url)
    finally:
        stop.set()
        killer.join(5)
