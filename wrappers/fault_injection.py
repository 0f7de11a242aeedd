"""``FaultInjection``: fire real faults into a RecoverableSandboxEnv while an agent runs.

Faults are chosen per step with a probability, or at given step numbers (1-based count of
``step`` calls this episode), or at given times (seconds after ``reset``). An action fault
fires ``delay_s`` into the step (uniform in [0, max_delay_s]): a fail-stop at a random
point of the action. ``checkpoint_fail`` / ``restore_fail`` arm the mechanism's
``phase_hook`` so the next capture / restore dies at a random named phase (by killing the
container or by raising inside the mechanism). ``injected`` lists what fired.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import gymnasium as gym
from pydantic import BaseModel, ConfigDict, Field

from belayer_env.faults import (
    ACTION_FAULTS,
    CHECKPOINT_PHASES,
    RESTORE_PHASES,
    FaultKind,
    InjectedFault,
    TransportBreaker,
    kill_container,
    kill_processes,
    oom_container,
)
from belayer_env.ownership import SANDBOX_NAME


class FaultInjectionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    probability: float = Field(0.0, ge=0, le=1)
    """Per-step probability of firing one fault of a kind drawn from ``kinds``."""
    kinds: list[FaultKind] = Field(default_factory=lambda: list(ACTION_FAULTS))
    at_steps: dict[int, FaultKind] = Field(default_factory=dict)
    at_times: dict[float, FaultKind] = Field(default_factory=dict)
    max_delay_s: float = Field(0.3, ge=0)
    """An action fault fires uniformly within this many seconds after the step starts."""
    seed: int | None = None


class FaultInjection(gym.Wrapper):
    def __init__(self, env: gym.Env, config: FaultInjectionConfig | None = None, **overrides: Any):
        super().__init__(env)
        base = config or FaultInjectionConfig()
        self.config = base.model_copy(update=overrides) if overrides else base
        self.rng = random.Random(self.config.seed)
        self.injected: list[dict[str, Any]] = []
        self._breaker = TransportBreaker(self.env.unwrapped.client)
        self._timers: list[threading.Timer] = []
        self._calls = 0
        self._armed: dict[str, tuple[str, str]] = {}  # "checkpoint"/"restore" -> (phase, how)
        self.env.unwrapped.checkpointer.phase_hook = self._phase_hook

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, **kwargs: Any) -> Any:
        self._cancel_timers()
        self._calls = 0
        result = self.env.reset(**kwargs)
        for at, kind in self.config.at_times.items():
            self._schedule(kind, float(at))
        return result

    def step(self, action: Any) -> Any:
        self._calls += 1
        kind = self.config.at_steps.get(self._calls)
        if kind is None and self.config.kinds and self.rng.random() < self.config.probability:
            kind = self.rng.choice(self.config.kinds)
        if kind is not None:
            self.fire(kind, delay_s=self.rng.uniform(0, self.config.max_delay_s))
        return self.env.step(action)

    def close(self) -> None:
        self._cancel_timers()
        super().close()

    # ------------------------------------------------------------------ faults

    def fire(self, kind: FaultKind, delay_s: float = 0.0) -> None:
        """Fire ``kind`` now (or after ``delay_s`` on a timer thread)."""
        if kind in ("checkpoint_fail", "restore_fail"):
            phases = CHECKPOINT_PHASES if kind == "checkpoint_fail" else RESTORE_PHASES
            self.arm(kind, self.rng.choice(phases), self.rng.choice(["kill", "raise"]))
            return
        if delay_s <= 0:
            self._fire_now(kind)
        else:
            self._schedule(kind, delay_s)

    def arm(self, kind: FaultKind, phase: str, how: str = "kill") -> None:
        """Fail the next checkpoint (or restore) at ``phase``: kill the container or raise."""
        self._armed["checkpoint" if kind == "checkpoint_fail" else "restore"] = (phase, how)

    def _schedule(self, kind: FaultKind, delay_s: float) -> None:
        timer = threading.Timer(delay_s, self._fire_now, args=(kind,))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _fire_now(self, kind: FaultKind) -> None:
        env = self.env.unwrapped
        sandbox = env.sandbox
        if sandbox is None:
            return
        client, cid = env.client, sandbox.container_id
        self.injected.append({"kind": kind, "call": self._calls, "container": cid[:12], "time": time.time()})
        if kind == "kill":
            kill_container(client, cid)
        elif kind == "oom":
            oom_container(client, cid)
        elif kind == "kill_processes":
            kill_processes(client, cid)
        elif kind == "break_transport":
            self._breaker.break_all()

    def _phase_hook(self, phase: str) -> None:
        op = "restore" if phase in RESTORE_PHASES and phase not in CHECKPOINT_PHASES else "checkpoint"
        armed = self._armed.get(op)
        if armed is None or armed[0] != phase:
            return
        del self._armed[op]
        self.injected.append({"kind": f"{op}_fail", "phase": phase, "how": armed[1], "call": self._calls,
                              "time": time.time()})
        if armed[1] == "raise":
            raise InjectedFault(f"injected fail-stop during {op} at phase {phase!r}")
        env = self.env.unwrapped
        if env.sandbox is not None:
            kill_container(env.client, env.sandbox.container_id)
        for c in env.client.api.containers(all=True, filters={"label": f"{SANDBOX_NAME}={env.name}"}):
            kill_container(env.client, c["Id"])

    def _cancel_timers(self) -> None:
        for t in self._timers:
            t.cancel()
        self._timers = []
