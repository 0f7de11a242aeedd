"""The fault schedule of a training run: real faults on every side, at configurable rates.

- env: the project's ``FaultInjection`` wrapper kills or OOM-kills the episode's container
  at a random instant of a step's cycle (per-step probability ``env_rate``, within
  ``env_window_s`` of the step's start: in the command or while the next one is generated);
- engine: a thread SIGKILLs the serving worker process (found through the supervisor) at
  exponentially distributed intervals (``worker_rate_per_min``);
- learner: the orchestrator SIGKILLs the learner process right after it starts saving the
  checkpoint of each step listed in ``learner_kill_steps``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time

from .config import FaultConfig


def wrap_env(env, config: FaultConfig, seed: int):
    """The env with real container faults injected (no-op wrapper when ``env_rate`` is 0)."""
    from belayer.wrappers.fault_injection import FaultInjection, FaultInjectionConfig

    return FaultInjection(env, FaultInjectionConfig(probability=config.env_rate, kinds=config.env_kinds,
                                                    max_delay_s=config.env_window_s, seed=seed))


class WorkerKiller:
    """SIGKILLs the engine's serving worker at random times, only while the engine is stable: a
    shadow armed and the last handover older than the supervisor's unhealthy window. A kill
    sooner would (rightly) exclude the device: a CI run's kill landed 2.3 s after a handover
    that had taken a cold start, 14 s after the previous kill."""

    def __init__(self, engine, config: FaultConfig, seed: int = 0):
        self.engine, self.config = engine, config
        self.rng = random.Random(seed + 7)
        self.kills: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-killer", daemon=True)
        self.started = False

    def start(self) -> WorkerKiller:
        """Idempotent: the schedule starts once (when the first weights are served)."""
        if not self.started and self.config.worker_rate_per_min > 0:
            self.started = True
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        floor = self.config.worker_min_gap_s
        mean = max(60.0 / self.config.worker_rate_per_min - floor, 1.0)
        gap = self.config.worker_first_kill_s
        while not self._stop.is_set():
            if gap is None:
                gap = floor + self.rng.expovariate(1.0 / mean)  # mean gap = 60/rate when that exceeds the floor
            if self._stop.wait(gap):  # a schedule interval, not a synchronisation
                return
            # kill only a stable engine's serving worker; otherwise try again shortly
            gap = None if self._kill_serving_worker() else 0.2

    def _kill_serving_worker(self) -> bool:
        with contextlib.suppress(Exception):
            self.engine.wait_ready(timeout=1.0, stable=True)  # raises while not stable: try again shortly
            slot = self.engine.status()["slots"]["w0"]
            if slot.get("routed") and slot.get("shadow_ready") and slot.get("worker_pid"):
                os.kill(int(slot["worker_pid"]), signal.SIGKILL)
                self.kills.append({"wall": time.time(), "pid": int(slot["worker_pid"])})
                return True
        return False
