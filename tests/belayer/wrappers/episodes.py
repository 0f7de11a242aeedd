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


def failing_fresh_sandboxes(env, times: int | None) -> None:
    """Fail the creation of ``env``'s fresh sandboxes ``times`` times (None: always), as the
    project's fault injector does (a phase hook raising ``InjectedFault``): with no checkpoint
    every restore is a fresh sandbox, so ``recovery_attempts`` of them put a sandbox beyond
    recovery. ``env`` is a ``RecoverableSandboxEnv`` or an adapter holding one as ``env``."""
    from belayer_env.common.phases import Phase
    from belayer_env.faults import InjectedFault

    left = {"n": times}

    def hook(phase: Phase) -> None:
        if phase == Phase.CREATED and (left["n"] is None or left["n"] > 0):
            if left["n"] is not None:
                left["n"] -= 1
            raise InjectedFault("injected: the host cannot create sandboxes")

    getattr(env, "env", env).add_phase_hook(hook)


def model_spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every run of loss-mask 1: the model's turns of a sample."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def read_json_line(proc, who: str) -> dict:
    """The next JSON line a driver process printed (other lines are its libraries' chatter)."""
    import json

    import pytest

    while True:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the {who} driver exited ({proc.wait()}): {proc.stderr.read()[-3000:]}")
        if line.startswith("{"):
            return json.loads(line)
