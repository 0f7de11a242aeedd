"""The committed trajectory: what a trainer may learn from, with every infra event labelled.

Only committed steps are kept. A rollback to boundary j drops steps j+1.. (their effects
are gone with the dead sandbox); the steps generated afterwards are marked
``regenerated`` and the event itself is kept in ``events``, so a trainer can keep, drop or
weight recovered trajectories. Infra error text lives here only, never in observations.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

EventKind = Literal["rollback", "checkpoint_ready", "checkpoint_failed", "checkpoint_abandoned",
                    "restore_failed", "degraded_restore", "sandbox_exited", "standby_preparing",
                    "standby_promoted"]


class StepRecord(BaseModel):
    step: int
    action: str
    observation: str
    returncode: int | None
    exec_s: float
    gen_s: float
    regenerated: bool = False
    """Generated after a rollback (its original version was lost with the sandbox)."""


class InfraEvent(BaseModel):
    kind: EventKind
    at_step: int
    """The boundary the episode was at (the failed step is ``at_step + 1``)."""
    to_step: int | None = None
    error: str | None = None
    """Exception type name (the recovery decision keys on it)."""
    message: str | None = None
    reason: str | None = None
    """``checkpoint_failed`` / ``checkpoint_abandoned``: why, in one line (also in that step's
    ``info["belayer"]["checkpoint_failed"]``)."""
    discarded_steps: int = 0
    exit_code: int | None = None
    """``sandbox_exited``: the code the sandbox's init exited with (an action ended it from inside)."""
    time: float = Field(default_factory=time.time)
    recovery_s: float | None = None
    """``rollback``: seconds from the failure's detection to the restored sandbox (fence + restore)."""
    recovery_parts: dict[str, float] = Field(default_factory=dict)
    """``rollback``: where ``recovery_s`` went, in seconds: ``fence`` (the dead sandbox killed
    and its name freed), ``wait_capture`` (a capture past its thaw, waited for), ``restore``
    (restores or a standby's promotion, failed attempts included), ``initial`` (a fresh
    sandbox and the task's setup, when no checkpoint was left)."""
    while_idle: bool = False
    """``rollback``: the sandbox died while the agent held the turn and was restored in the
    background (``EnvConfig.recover_while_idle``); no action was interrupted."""
    waited_s: float | None = None
    """``rollback`` while idle: how long the agent's next call waited for that restore to end."""


class Trajectory(BaseModel):
    task: str = ""
    steps: list[StepRecord] = Field(default_factory=list)
    events: list[InfraEvent] = Field(default_factory=list)

    def commit(self, record: StepRecord) -> None:
        if record.step != len(self.steps) + 1:
            raise ValueError(f"step {record.step} does not follow boundary {len(self.steps)}")
        self.steps.append(record)

    def rollback(self, to_step: int, *, at_step: int, error: BaseException | None,
                 regenerate_from: int | None = None, recovery_s: float | None = None,
                 while_idle: bool = False, recovery_parts: dict[str, float] | None = None) -> InfraEvent:
        discarded = len(self.steps) - to_step
        del self.steps[to_step:]
        event = InfraEvent(kind="rollback", at_step=at_step, to_step=to_step,
                           error=type(error).__name__ if error else None,
                           message=str(error)[:2000] if error else None, discarded_steps=discarded,
                           recovery_s=recovery_s, while_idle=while_idle, recovery_parts=recovery_parts or {})
        self.events.append(event)
        return event

    def record(self, kind: EventKind, at_step: int, error: BaseException | None = None,
               **extra: Any) -> InfraEvent:
        event = InfraEvent(kind=kind, at_step=at_step, error=type(error).__name__ if error else None,
                           message=str(error)[:2000] if error else None, **extra)
        self.events.append(event)
        return event

    @property
    def recovered(self) -> bool:
        return any(e.kind == "rollback" for e in self.events)

    def observation_at(self, step: int) -> str | None:
        """The observation the agent saw at boundary ``step`` (None for boundary 0)."""
        return self.steps[step - 1].observation if step > 0 else None
