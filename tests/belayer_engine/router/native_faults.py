"""A native ``/generate`` that loses its serving worker to a real SIGKILL mid-generation.

The request runs in a thread; the test waits (bounded polling, no sleeps) until the router
has recorded ``kill_at`` generated tokens of it, then SIGKILLs the serving worker's process
group. Shared by the reference-worker and the real-SGLang tests.
"""

from __future__ import annotations

import os
import signal
import threading

from tests.belayer_engine.conftest import poll

from .native_client import generate


def generated_so_far(engine, rid: str) -> int:
    run = engine.router.native.running.get(rid) if engine.router and engine.router.native else None
    return len(run.gen.generated) if run is not None else 0


def generate_through_a_sigkill(engine, base: str, body: dict, kill_at: int, headers=None,
                               timeout: float = 300) -> tuple[int, object, int]:
    """(status, response or chunks, killed pid) of ``body`` (which carries a ``rid``),
    with the serving worker SIGKILLed once ``kill_at`` tokens were generated."""
    result: dict = {}

    def send() -> None:
        try:
            result["out"] = generate(base, body, headers, timeout)
        except BaseException as exc:  # reported by the main thread
            result["error"] = exc

    t = threading.Thread(target=send, daemon=True)
    t.start()
    poll(lambda: "out" in result or "error" in result or generated_so_far(engine, body["rid"]) >= kill_at,
         timeout, f"{kill_at} generated tokens of {body['rid']}", interval=0.005)
    assert "out" not in result and "error" not in result, f"the request ended before the kill: {result}"
    pid = engine.worker_pid(0)
    os.killpg(pid, signal.SIGKILL)  # the worker is its own process group's leader
    t.join(timeout)
    assert not t.is_alive(), "the request did not end"
    if "error" in result:
        raise result["error"]
    status, out = result["out"]
    return status, out, pid
