"""Pluggable rewards, computed in the sandbox at termination.

A reward that runs a command (the task's tests) is part of the final step: if the sandbox
dies while it runs, the whole step is an infrastructure failure and is recovered like any
other, so a reward is never computed on a half-dead sandbox.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from belayer_env.env.trajectory import Trajectory
from belayer_env.sandbox.container import DockerSandbox


@runtime_checkable
class Reward(Protocol):
    def __call__(self, sandbox: DockerSandbox, trajectory: Trajectory, submission: str) -> float:
        """Reward of a terminated episode (``submission``: output after the submit line)."""


class ZeroReward:
    """No reward signal (the trainer scores trajectories itself)."""

    def __call__(self, sandbox: DockerSandbox, trajectory: Trajectory, submission: str) -> float:
        return 0.0


class CommandReward:
    """1.0 when ``command`` (e.g. the task's test suite) exits 0 in the final sandbox, else 0.0."""

    def __init__(self, command: str, timeout: float | None = None, cwd: str = ""):
        self.command, self.timeout, self.cwd = command, timeout, cwd

    def __call__(self, sandbox: DockerSandbox, trajectory: Trajectory, submission: str) -> float:
        result = sandbox.execute(self.command, cwd=self.cwd, timeout=self.timeout)
        return 1.0 if result["returncode"] == 0 else 0.0


class SubmissionReward:
    """1.0 when the submitted text equals ``expected`` (after stripping whitespace)."""

    def __init__(self, expected: str):
        self.expected = expected.strip()

    def __call__(self, sandbox: DockerSandbox, trajectory: Trajectory, submission: str) -> float:
        return 1.0 if submission.strip() == self.expected else 0.0
