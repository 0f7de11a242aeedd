"""Consistency harness: N trials, each with a real fail-stop, must converge to the golden state.

A fault-free run of the workload gives the golden state (whole-FS tree hash, the
server's in-memory counter, the db, the logs). Each trial runs the same scripted agent
(after a rollback to j it regenerates action j+1: the script is deterministic) with one
fault placed uniformly: during an action (a random action, a random instant within its
fault-free duration, a random kind of kill), during a checkpoint (a random capture, a
random instant within its fault-free duration, or a crash at a random phase), or during a
restore (an action is killed to cause one, then the restore dies at a random phase).
With ``standby=True`` the env keeps a standby (``restore/standby.py``) and a fourth kind of
fault hits it: while it is prepared (``standby_frozen``) or while a rollback thaws it
(``standby_thawed``; an action is killed to cause that rollback). With ``spare=True``
restores start in a container created ahead (``EnvConfig(restore_spare=True)``), restore
faults included. With ``idle=True`` the env restores a sandbox that dies between actions in
the background (``EnvConfig(recover_while_idle=True)``) and a fifth kind of fault kills the
sandbox while the scripted agent "thinks" after an action (a random think time, the fault at
a random instant that may fall into it or into the next action).
Where and when each trial's fault lands, and firing it: ``fault_plan``.
A trial passes iff its final state equals the golden one and every effect happened
exactly once. A trial that cannot finish is a counterexample too, never skipped.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from pydantic import BaseModel, Field

from belayer_core.errors import InfraError, UsageError
from belayer_env.consistency.fault_plan import Fault, Injector, draw_fault
from belayer_env.consistency.workload import ACTIONS, N_STEPS, SETUP, exactly_once_violations, probe
from belayer_env.env.policy import AlwaysPolicy
from belayer_env.env.recoverable import EnvConfig, RecoverableSandboxEnv

INFRA_WORDS = ("SandboxLost", "DaemonUnavailable", "RestoreFailed", "CheckpointFailed", "InjectedFault",
               "Docker", "docker", "container", "Traceback", "fail-stop")
MAX_CALLS = 6 * N_STEPS  # a trial that needs more step calls than this is not converging


class TrialResult(BaseModel):
    trial: int
    fault: Fault
    ok: bool
    problems: list[str] = Field(default_factory=list)
    rollbacks: list[int] = Field(default_factory=list)
    """The boundary each rollback went back to."""
    duration_s: float = 0.0
    events: list[str] = Field(default_factory=list)
    """The env's infra events (kind@step: error), for reading a counterexample."""


class ConsistencyReport(BaseModel):
    trials: int
    passed: int
    counterexamples: list[TrialResult]
    faults_fired: int
    rollbacks: int
    by_where: dict[str, int]
    golden_s: float
    total_s: float
    seed: int
    jobs: int = 1


class _Golden(BaseModel):
    state: dict[str, Any]
    exec_s: list[float]
    capture_s: list[float]
    duration_s: float


def _make_env(checkpoint_every: int, standby: bool = False, spare: bool = False,
              idle: bool = False) -> RecoverableSandboxEnv:
    policy = AlwaysPolicy(every=checkpoint_every)
    return RecoverableSandboxEnv(EnvConfig(keep_checkpoints=N_STEPS, standby=standby, restore_spare=spare,
                                           recover_while_idle=idle),
                                 checkpoint_policy=policy)


def _golden(checkpoint_every: int, standby: bool = False, spare: bool = False, idle: bool = False) -> _Golden:
    env = _make_env(checkpoint_every, standby, spare, idle)
    t0 = time.monotonic()
    try:
        env.reset(options={"setup": SETUP})
        for action in ACTIONS:
            _obs, _r, _te, _tr, info = env.step(action)
            if info.get("returncode") != 0:
                raise RuntimeError(f"the workload failed fault-free at step {info['belayer']['step']}: {_obs[-500:]}")
        env.settle()
        state = probe(env.sandbox)
        problems = exactly_once_violations(state)
        if problems:
            raise RuntimeError(f"the fault-free run is not exactly-once: {problems}")
        return _Golden(state=state, exec_s=[s.exec_s for s in env.trajectory.steps],
                       capture_s=[c.total_s for c in env.checkpointer.ready] or [0.5],
                       duration_s=time.monotonic() - t0)
    finally:
        env.close()


def run_trial(trial: int, fault: Fault, golden: _Golden, checkpoint_every: int,
              standby: bool = False, spare: bool = False, idle: bool = False) -> TrialResult:
    env = _make_env(checkpoint_every, standby, spare, idle)
    injector = Injector(env, fault)
    t0 = time.monotonic()
    result = TrialResult(trial=trial, fault=fault, ok=False)
    state = None
    try:
        seen = [env.reset(options={"setup": SETUP})[0]]  # observation at each boundary
        committed, calls = 0, 0
        while committed < N_STEPS:
            calls += 1
            if calls > MAX_CALLS:
                raise RuntimeError(f"no convergence after {MAX_CALLS} step calls")
            injector.before_call(committed, calls)
            obs, _r, _te, _tr, info = env.step(ACTIONS[committed])
            result.problems += [f"infra text {w!r} in an observation" for w in INFRA_WORDS if w in obs]
            rollback = info["belayer"].get("rollback")
            restored = info["belayer"].get("recovered_while_idle")
            if restored is not None and rollback is None:  # restored at this boundary, then the action ran
                result.rollbacks.append(restored["to_step"])
                if restored["to_step"] != committed:
                    result.problems.append(f"restored while idle to {restored['to_step']}, not to boundary {committed}")
            if rollback is not None:
                result.rollbacks.append(rollback["to_step"])
                committed = rollback["to_step"]
                if obs != seen[committed]:
                    result.problems.append(f"rollback to {committed} returned another observation than boundary {committed}'s")
                del seen[committed + 1:]
                continue
            if info.get("returncode") != 0:
                result.problems.append(f"action {committed + 1} failed: {obs[-300:]!r}")
                break
            committed += 1
            seen.append(obs)
            injector.after_call(committed)
            if committed == N_STEPS:  # the sandbox may have died after the last action:
                injector.cancel()     # probing it is one more step, recovered like any other
                env.settle()
                try:
                    state = probe(env.sandbox)
                except InfraError:
                    _obs, _r, _te, _tr, info = env.step("true")
                    if "recovered_while_idle" in info["belayer"] and "rollback" not in info["belayer"]:
                        result.rollbacks.append(committed)
                    if "rollback" in info["belayer"]:
                        committed = info["belayer"]["rollback"]["to_step"]
                        del seen[committed + 1:]
                        result.rollbacks.append(committed)
                    state = probe(env.sandbox) if committed == N_STEPS else None
    except (InfraError, RuntimeError) as e:
        injector.cancel()
        result.problems.append(f"trial did not finish: {type(e).__name__}: {e}")
        state = None
    finally:
        result.fault.fired = injector.fired
        injector.faults.close()
        result.events = [f"{e.kind}{' (while idle)' if e.while_idle else ''}@{e.at_step}->{e.to_step}: "
                         f"{e.error}: {(e.message or '')[:160]}"
                         for e in env.trajectory.events]
        env.close()
    if state is not None:
        result.problems += exactly_once_violations(state)
        for key, want in golden.state.items():
            if state.get(key) != want:
                result.problems.append(f"{key} differs from golden: {state.get(key)!r} != {want!r}")
    result.ok = not result.problems
    result.duration_s = time.monotonic() - t0
    return result


def run_consistency(trials: int, *, seed: int = 0, checkpoint_every: int = 2, standby: bool = False,
                    spare: bool = False, idle: bool = False, jobs: int = 1,
                    progress: Callable[[TrialResult], None] | None = None) -> ConsistencyReport:
    """Golden run, then ``trials`` faulty trials; counterexamples are reported, never hidden.

    ``standby``: the env keeps a standby and faults also hit its preparation and thaw.
    ``spare``: the env keeps a restore spare (a container created ahead for restores).
    ``idle``: the env restores deaths between actions in the background, and faults hit there.
    ``jobs``: trials run at once, each its own env and sandbox (the schedule of faults is
    the seed's whatever ``jobs`` is; ``progress`` sees trials as they end, on this thread)."""
    if jobs < 1:
        raise UsageError(f"jobs must be >= 1, got {jobs}")
    t0 = time.monotonic()
    rng = random.Random(seed)
    golden = _golden(checkpoint_every, standby, spare, idle)
    faults = [draw_fault(rng, golden.exec_s, golden.capture_s, checkpoint_every, standby, idle) for _ in range(trials)]
    results = []
    with ThreadPoolExecutor(jobs, thread_name_prefix="consistency-trial") as pool:
        running = [pool.submit(run_trial, i, fault, golden, checkpoint_every, standby, spare, idle)
                   for i, fault in enumerate(faults)]
        for done in as_completed(running):
            results.append(done.result())
            if progress:
                progress(results[-1])
    results.sort(key=lambda r: r.trial)
    by_where: dict[str, int] = {}
    for r in results:
        by_where[r.fault.where] = by_where.get(r.fault.where, 0) + 1
    return ConsistencyReport(
        trials=trials, passed=sum(r.ok for r in results), counterexamples=[r for r in results if not r.ok],
        faults_fired=sum(r.fault.fired for r in results), rollbacks=sum(len(r.rollbacks) for r in results),
        by_where=by_where, golden_s=golden.duration_s, total_s=time.monotonic() - t0, seed=seed, jobs=jobs)
