"""Episode settings the adapter tests share (slime, verl, AReaL): a short greedy-friendly
episode, and the faults that put a sandbox beyond the env's recovery."""

from __future__ import annotations

EPISODE = {"max_turns": 3, "max_tokens_per_turn": 24, "checkpoint_policy": "always",
           "env": {"sandbox": {"max_output_bytes": 96}}}
# beyond the env's recovery: no checkpoint, one restore attempt, and that restore (the fresh
# sandbox of boundary 0) armed at turn 1 to fail at its "created" phase (seed 1), then the
# container SIGKILLed in turn 2
UNRECOVERABLE = {"checkpoint_policy": "never", "env": {**EPISODE["env"], "recovery_attempts": 1},
                 "faults": {"at_steps": {1: "restore_fail", 2: "kill"}, "max_delay_s": 0.0, "seed": 1}}


def first_sandbox_only(episode: dict) -> dict:
    """``episode`` with its faults in each sample's first sandbox only (a fresh one is spared)."""
    return {**episode, "faults": {**episode["faults"], "episodes": 1}}
