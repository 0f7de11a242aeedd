"""Where and when a consistency trial's one fault lands, and placing it while the trial runs.

``draw_fault`` places it uniformly: during an action (a random action, a random instant
within its fault-free duration, a random kind of kill), during a checkpoint (a random
capture, a random instant within its fault-free duration, or a crash at a random phase),
during a restore (an action is killed to cause one, then the restore dies at a random
phase), while a standby is prepared or thawed (``standby``), or between actions while the
agent thinks (``idle``). ``Injector`` fires it at that point of the trial; firing itself is
``FaultInjector``'s (``belayer_env.faults.inject``): real kills, real phase failures.
"""

from __future__ import annotations

import random
import time
from typing import Literal

from pydantic import BaseModel

from belayer_env.common.phases import CAPTURE_PHASES, RESTORE_PHASES, Phase
from belayer_env.consistency.workload import N_STEPS
from belayer_env.env.recoverable import RecoverableSandboxEnv
from belayer_env.faults.inject import ACTION_FAULTS, FaultInjector

Where = Literal["action", "checkpoint", "restore", "standby", "idle"]
IDLE_FAULTS = ("kill", "oom", "kill_processes")
THINK_S = 1.0
"""Longest think time of the scripted agent after the action an idle fault follows."""
STANDBY_PHASES = (Phase.STANDBY_FROZEN, Phase.STANDBY_THAWED)
STANDBY_WAIT_S = 120.0


class Fault(BaseModel):
    where: Where
    step: int
    """The action (1-based) during / after which the fault fires."""
    kind: str
    delay_s: float = 0.0
    phase: str | None = None
    think_s: float = 0.0
    """``idle``: the agent's think time before its next action (the fault fires ``delay_s`` in)."""
    fired: bool = False



def draw_fault(rng: random.Random, exec_s: list[float], capture_s: list[float], checkpoint_every: int,
               standby: bool = False, idle: bool = False) -> Fault:
    """One fault, placed uniformly (module docstring), timed by the fault-free run: ``exec_s``
    of each action, ``capture_s`` of each capture."""
    where: Where = rng.choice(["action", "checkpoint", "restore", *(["standby"] if standby else []),
                               *(["idle"] if idle else [])])
    if where == "idle":
        think = rng.uniform(0, THINK_S)
        return Fault(where=where, step=rng.randint(1, N_STEPS - 1), kind=rng.choice(IDLE_FAULTS),
                     delay_s=rng.uniform(0, think * 1.2), think_s=think)
    if where == "action":
        step = rng.randint(1, N_STEPS)
        return Fault(where=where, step=step, kind=rng.choice(ACTION_FAULTS),
                     delay_s=rng.uniform(0, exec_s[step - 1]))
    if where == "checkpoint":
        step = rng.choice([s for s in range(1, N_STEPS) if s % checkpoint_every == 0])
        if rng.random() < 0.5:
            return Fault(where=where, step=step, kind="kill", delay_s=rng.uniform(0, max(capture_s)))
        return Fault(where=where, step=step, kind=rng.choice(["kill", "raise"]), phase=rng.choice(CAPTURE_PHASES))
    if where == "standby":  # armed once the capture of ``step`` starts; its standby follows
        step = rng.choice([s for s in range(1, N_STEPS) if s % checkpoint_every == 0])
        return Fault(where=where, step=step, kind=rng.choice(["kill", "raise"]), phase=rng.choice(STANDBY_PHASES))
    step = rng.randint(checkpoint_every + 1, N_STEPS)  # a checkpoint exists: a real restore
    phase = rng.choice(RESTORE_PHASES)
    return Fault(where=where, step=step, kind="raise" if phase == "created" else rng.choice(["kill", "raise"]),
                 phase=phase)


class Injector:
    """Places one trial's fault: when to fire it is planned here, firing is ``FaultInjector``'s."""

    def __init__(self, env: RecoverableSandboxEnv, fault: Fault):
        self.fault = fault
        self.faults = FaultInjector(env)
        self.env = env
        self._caused = False

    def before_call(self, committed: int, call: int) -> None:
        f = self.fault
        if f.where == "standby":
            self._cause_thaw(committed)
            return
        if self.fired or committed + 1 != f.step:
            return
        if f.where == "action":
            self.faults.fire(f.kind, f.delay_s)  # type: ignore[arg-type]
        elif f.where == "restore" and not self._caused:
            self._caused = True
            self.env.settle()  # let the newest capture publish, so recovery really restores it
            if self.env.recovery.standby is not None:
                self.env.recovery.standby.discard()  # ...rather than promote a standby ("standby" trials do)
            self.faults.arm("restore", f.phase, f.kind)  # type: ignore[arg-type]
            self.faults.fire("kill")  # the action dies at once: recovery must restore...

    def _cause_thaw(self, committed: int) -> None:
        """A thaw fault needs a rollback onto the standby: kill the action after its checkpoint."""
        f = self.fault
        if self.fired or self._caused or f.phase != Phase.STANDBY_THAWED or committed != f.step:
            return
        self._caused = True
        self.env.settle()  # the capture publishes, its standby is prepared...
        standby = self.env.recovery.standby
        deadline = time.monotonic() + STANDBY_WAIT_S
        while standby is not None and not (standby.ready() or standby.error) and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded poll of a background thread's state, not a sleep as synchronisation
        self.faults.fire("kill")  # ...and the rollback that thaws it is caused here

    def after_call(self, committed: int) -> None:
        f = self.fault
        if not self.fired and f.where == "idle" and committed == f.step:
            self.faults.fire(f.kind, f.delay_s)  # type: ignore[arg-type]
            time.sleep(f.think_s)  # the agent generating its next action (the workload, not a wait for the fault)
            return
        if not self.fired and f.where == "standby" and committed == f.step:
            self.faults.arm("restore", f.phase, f.kind)  # type: ignore[arg-type]
            return
        if self.fired or f.where != "checkpoint" or committed != f.step:
            return
        if f.phase is None:
            self.faults.fire("kill", f.delay_s)  # ...the capture just started on a background thread
        else:
            self.faults.arm("checkpoint", f.phase, f.kind)  # type: ignore[arg-type]

    @property
    def fired(self) -> bool:
        """Whether the planned fault fired (a restore fault: the phase failure, not its cause)."""
        if self.fault.where in ("restore", "standby"):
            return any(r["kind"] == "restore_fail" for r in self.faults.injected)
        return bool(self.faults.injected)

    def cancel(self) -> None:
        self.faults.cancel()
