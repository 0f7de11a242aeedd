"""``FaultInjection``: fire real faults into a RecoverableSandboxEnv while an agent runs.

Faults are chosen per step with a probability, or at given step numbers (1-based count of
``step`` calls this episode), or at given times (seconds after ``reset``). An action fault
fires ``delay_s`` into the step (uniform in [0, max_delay_s]): a fail-stop at a random
point of the action. ``checkpoint_fail`` / ``restore_fail`` arm the next capture / restore
to die at a random named phase (by killing the container or by raising inside the
mechanism). ``injected`` lists what fired. The faults themselves are the core's
``belayer_env.faults.inject.FaultInjector``; this wrapper only decides when.
"""

from __future__ import annotations

import random
from typing import Any

import gymnasium as gym
from pydantic import ConfigDict, Field

from belayer_env.common.phases import CAPTURE_PHASES, RESTORE_PHASES, Phase
from belayer_env.faults.inject import ACTION_FAULTS, FaultInjector, FaultKind, How
from belayer_env.sandbox.config import StrictModel


class FaultInjectionConfig(StrictModel):
    model_config = ConfigDict(extra="forbid")

    probability: float = Field(0.0, ge=0, le=1)
    """Per-step probability of firing one fault of a kind drawn from ``kinds``."""
    kinds: list[FaultKind] = Field(default_factory=lambda: list(ACTION_FAULTS))
    at_steps: dict[int, FaultKind] = Field(default_factory=dict)
    at_times: dict[float, FaultKind] = Field(default_factory=dict)
    max_delay_s: float = Field(0.3, ge=0)
    """An action fault fires uniformly within this many seconds after the step starts."""
    seed: int | None = None
    episodes: int | None = Field(None, ge=0)
    """Fire only in the first this many episodes (``reset`` calls) of this wrapper; None: in every one
    (an ``InfraPolicy`` retry resets the same env: ``episodes=1`` spares the fresh sandbox)."""


class FaultInjection(gym.Wrapper):
    def __init__(self, env: gym.Env, config: FaultInjectionConfig | None = None, **overrides: Any):
        super().__init__(env)
        self.config = FaultInjectionConfig.merged(config or FaultInjectionConfig(), overrides)
        self.rng = random.Random(self.config.seed)
        self._context = {"call": 0}
        self._episodes = 0
        self.injector = FaultInjector(self.env.unwrapped, context=self._context)

    @property
    def injected(self) -> list[dict[str, Any]]:
        return self.injector.injected

    # ------------------------------------------------------------------ gymnasium API

    @property
    def armed(self) -> bool:
        """Whether faults fire in this episode (``episodes``)."""
        return self.config.episodes is None or self._episodes <= self.config.episodes

    def reset(self, **kwargs: Any) -> Any:
        self.injector.cancel()
        self._context["call"] = 0
        self._episodes += 1
        if not self.armed:
            self.injector.disarm()  # a capture or restore armed in an earlier episode stays unharmed
        result = self.env.reset(**kwargs)
        for at, kind in self.config.at_times.items() if self.armed else ():
            self.fire(kind, delay_s=float(at))
        return result

    def step(self, action: Any) -> Any:
        self._context["call"] += 1
        kind = self.config.at_steps.get(self._context["call"]) if self.armed else None
        if kind is None and self.armed and self.config.kinds and self.rng.random() < self.config.probability:
            kind = self.rng.choice(self.config.kinds)
        if kind is not None:
            self.fire(kind, delay_s=self.rng.uniform(0, self.config.max_delay_s))
        return self.env.step(action)

    def close(self) -> None:
        self.injector.close()
        super().close()

    # ------------------------------------------------------------------ faults

    def fire(self, kind: FaultKind, delay_s: float = 0.0) -> None:
        """Fire ``kind`` now (or after ``delay_s`` on a timer thread)."""
        if kind in ("checkpoint_fail", "restore_fail"):
            phases = CAPTURE_PHASES if kind == "checkpoint_fail" else RESTORE_PHASES
            self.arm(kind, self.rng.choice(phases), self.rng.choice(["kill", "raise"]))
            return
        self.injector.fire(kind, delay_s)  # type: ignore[arg-type]

    def arm(self, kind: FaultKind, phase: Phase | str, how: How = "kill") -> None:
        """Fail the next checkpoint (or restore) at ``phase``: kill the container or raise."""
        self.injector.arm("checkpoint" if kind == "checkpoint_fail" else "restore", phase, how)
