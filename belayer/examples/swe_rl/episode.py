"""What an agent episode leaves behind for the learner: turns (token ids) plus infra labels.

Kept apart from ``agent`` (openai, the env) so that the learner imports no client code.
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class Turn(BaseModel):
    prompt_ids: list[int]
    completion_ids: list[int]
    weight_version: int | None
    worker_recoveries: int = 0


class Episode(BaseModel):
    """A committed trajectory plus its infra labels (what the learner trains on)."""

    task_id: str
    turns: list[Turn] = Field(default_factory=list)
    reward: float = 0.0
    env_rollbacks: int = 0
    worker_recoveries: int = 0
    infra_events: list[str] = Field(default_factory=list)
    failed: str | None = None
    """Set when an infra failure could not be recovered: the episode is dropped, not scored 0."""
    stale: bool = False
    """A response came from another weight version than the one this episode was meant for."""
    seconds: float = 0.0
    lost_s: float = 0.0
    """Work redone because of env failures: time since the restored boundary was reached."""
    lost_s_without: float = 0.0
    """The same without recovery: time since the episode (re)started from scratch, plus a
    fresh sandbox and the task's setup again (this episode's own reset time)."""
    rollbacks: list[dict] = Field(default_factory=list)
    """Per env rollback: fault step, boundary restored, timings, the env's checkpoint events."""

    @property
    def infra_touched(self) -> bool:
        return bool(self.env_rollbacks or self.worker_recoveries or self.failed)

    @property
    def trainable(self) -> bool:
        return self.failed is None and not self.stale and bool(self.turns)
