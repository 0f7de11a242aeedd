"""The toy tasks: write a word into a file. The reward is read from the sandbox.

Kept tiny on purpose (the policy is the embedded byte-level model, bytes are tokens): a
task asks for ``WORD`` in ``notes.txt``; the expert writes it (``echo WORD > notes.txt``)
and reads it back (``cat notes.txt``). ``FileReward`` runs in the episode's final
sandbox when the harness submits: 1.0 for the exact word, 0.5 for a ``notes.txt`` with
anything else in it, 0.25 for some other file written in the task's directory, 0.0 for
none (a real, graded signal a GRPO group can rank).
"""

from __future__ import annotations

from dataclasses import dataclass

WORKDIR = "/tmp/work"
FILE = "notes.txt"
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta")


@dataclass(frozen=True)
class Task:
    word: str

    @property
    def prompt(self) -> str:
        return f"Write the word {self.word} into {FILE}."

    @property
    def expert(self) -> list[str]:
        """The expert's commands, one per turn."""
        return [f"echo {self.word} > {FILE}", f"cat {FILE}"]

    def reset_options(self) -> dict:
        return {"task": self.prompt, "setup": f"mkdir -p {WORKDIR}"}


TASKS = [Task(w) for w in WORDS]
BY_PROMPT = {t.prompt: t for t in TASKS}


class FileReward:
    """The env's reward (``belayer_env.env.rewards.Reward``): the task's file, read in the sandbox."""

    def __init__(self, task: Task):
        self.task = task

    def __call__(self, sandbox, trajectory, submission: str) -> float:
        result = sandbox.execute(f"cat {FILE}", cwd=WORKDIR, timeout=10)
        if result["returncode"] == 0:
            return 1.0 if result["output"].strip() == self.task.word else 0.5
        listing = sandbox.execute("ls -A", cwd=WORKDIR, timeout=10)
        return 0.25 if listing["returncode"] == 0 and listing["output"].strip() else 0.0
