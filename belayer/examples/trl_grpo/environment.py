"""The sandbox TRL's ``environment_factory`` rolls out in (TRL 1.16, ``GRPOTrainer``).

TRL's multi-turn environment API: ``environment_factory()`` makes one ``SandboxEnvironment``
per rollout (TRL keeps them in a pool and resets them for each batch); TRL calls its
``reset(**row)`` before generating and exposes its public methods as tools (here one,
``bash``), runs the tool calls it parses from the model's completions (the chat template's
``<tool_call>`` JSON) and generates again after each tool response, masking tool tokens out
of the loss. The engine generates (``trainer.py``).

Faults fire here, for real: ``Plan.kill_container_at == n`` SIGKILLs the rollout's container
once its ``bash`` call n-1 returned (n = 1: once it was reset) and that boundary's checkpoint
is written, i.e. while the model writes call n (the env restores the boundary in the background, CRIU included, and
call n runs on the restored sandbox); ``beyond_recovery_at`` does the same with every
restore of that sandbox failing.

Infrastructure failures (``belayer.wrappers.infra_policy``): a rollback to an older boundary
or an exhausted recovery leaves TRL's conversation ahead of the sandbox, so this rollout is
marked ``retry`` (its remaining calls do nothing) and the trainer rolls it out again from its
prompt in a fresh sandbox (``restart``); an exhausted recovery counts against
``InfraPolicy.retries``, past which the rollout is dropped with its group.
"""

from __future__ import annotations

import threading
from typing import Any

from belayer.wrappers.infra_policy import InfraPolicy, PolicyEnv, SampleDropped
from belayer_env.env.config import SUBMIT_MARKER
from belayer_env.faults.inject import FaultInjector

from .episode import OBS_CHARS, EpisodeConfig, Plan, Sample, doom_sandbox, make_env
from .tasks import BY_PROMPT


class SandboxEnvironment:
    """One rollout's sandbox, as TRL's ``environment_factory`` wants it: ``reset`` and tools
    (every public method is a tool for TRL, so the rest are private to the trainer)."""

    def __init__(self, cfg: EpisodeConfig, plans: PlanQueue):
        self._cfg, self._plans = cfg, plans
        self._env = self._policy = self._injector = None
        self.sample: Sample | None = None
        self.state = "idle"  # ok | retry (the conversation is ahead of the sandbox) | dropped
        self.trained = True  # False: dropped, or in a group with a dropped rollout (the trainer sets it)
        self._exhausted = False  # why the last retry: recovery exhausted (True) or a rollback (False)
        self._restarts = 0
        self._scored = False

    def reset(self, **row: Any) -> None:
        self._close()  # TRL reuses instances across batches: the last rollout's sandbox goes
        prompt = row["prompt"]
        self._task = BY_PROMPT[prompt if isinstance(prompt, str) else prompt[-1]["content"]]
        self._plan = self._plans.take()
        self.sample = Sample(task=self._task.prompt)
        self._restarts, self.trained = 0, True
        self._start()
        if self.state == "ok":
            self._fire_planned(1)  # TRL generates call 1 right after the batch's resets
        return None

    def bash(self, command: str) -> str:
        """Run one bash command in the task's sandbox and return its exit code and output.

        Args:
            command: The bash command to run.

        Returns:
            The command's exit code and output.
        """
        if self.state != "ok":
            return ""  # this rollout is rolled out again (or dropped): its calls change nothing
        if self._calls >= self._cfg.turns:  # the env keeps its last step for the harness's submit
            return f"error: at most {self._cfg.turns} bash calls in this task"
        self._calls += 1
        self.sample.tool_calls += 1
        obs, _, _, _, _ = self._step(command)
        if self.state != "ok":
            return ""
        self._fire_planned(self._calls + 1)
        return obs if len(obs) <= OBS_CHARS else obs[:OBS_CHARS] + "..."

    # ------------------------------------------------------------------ the trainer's side

    def _score(self) -> None:
        """The task's reward, read in the final sandbox (the harness submits, as ``run_episode``
        does); a failure here marks the rollout ``retry`` like one in a ``bash`` call."""
        if self.state == "ok" and not self._scored:
            _, reward, terminated, _, _ = self._step(f"echo {SUBMIT_MARKER}")
            if self.state == "ok":
                self.sample.reward, self._scored = (float(reward) if terminated else 0.0), True

    def _restart(self) -> None:
        """A fresh sandbox for this rollout, its conversation rolled out again from the prompt
        (the infrastructure policy's retry); past ``InfraPolicy.retries`` it is dropped."""
        infra = self._cfg.infra
        if self._exhausted:  # PolicyEnv's fresh sandbox, reported as a rollback to boundary 0
            self.sample.fresh_sandbox_retries += 1
            self.sample.env_recoveries += 1
            self.sample.restored.append(0)
            if self.sample.fresh_sandbox_retries > infra.retries:
                self._drop(f"SampleDropped: {infra.retries} fresh sandbox(es) failed too")
                return
        self._restarts += 1
        if self._restarts > infra.max_rollbacks:
            self._drop(f"SampleDropped: rolled out again {infra.max_rollbacks} times")
            return
        self._close()
        self._plan = Plan()  # the retry runs without the planned faults
        self._start()

    def _close(self) -> None:
        if self._injector is not None:
            self._injector.close()
        if self._env is not None:
            self._env.close()
        self._env = self._policy = self._injector = None

    # ------------------------------------------------------------------ internals

    def _fire_planned(self, call: int) -> None:
        """The planned container kill, if it is for ``call`` (the one the model writes next)."""
        if call in (self._plan.kill_container_at, self._plan.beyond_recovery_at):
            self._env.settle(timeout=120)  # this boundary's checkpoint written: the container dies now
            if self._plan.beyond_recovery_at == call:
                doom_sandbox(self._env)
                self.sample.beyond_recovery += 1
            self._injector.fire("kill")
            self.sample.container_kills += 1

    def _start(self) -> None:
        self._env = make_env(self._task, self._cfg)
        # retries=0: an exhausted recovery surfaces as SampleDropped here, the retry is _restart's
        self._policy = PolicyEnv(self._env, InfraPolicy(retries=0, max_rollbacks=self._cfg.infra.max_rollbacks))
        self._injector = FaultInjector(self._env)
        self._calls, self._scored = 0, False
        self.state = "ok"
        try:
            self._policy.reset(options=self._task.reset_options())
        except SampleDropped:
            self._exhausted, self.state = True, "retry"

    def _step(self, command: str) -> tuple:
        try:
            result = self._policy.step(command)
        except SampleDropped:
            self._exhausted, self.state = True, "retry"
            return "", 0.0, False, False, {"belayer": {}}
        belayer = result[4].get("belayer", {})
        rollback, idle = belayer.get("rollback"), belayer.get("recovered_while_idle")
        if rollback is not None or idle is not None:
            self.sample.env_recoveries += 1
            self.sample.restored.append(int((rollback or idle)["to_step"]))
        if rollback is not None:  # an older boundary: TRL's conversation cannot be cut back
            self.sample.rolled_back_turns += 1
            self._exhausted, self.state = False, "retry"
        return result

    def _drop(self, why: str) -> None:
        self.state = "dropped"
        self.sample.failed = why
        self._close()


class PlanQueue:
    """Hands the rollouts of each step their fault plans in order (``Rollouts.plan``'s rule):
    TRL resets ``batch`` environments per step, in the batch's order."""

    def __init__(self, plan, batch: int):
        self._plan, self._batch, self._next, self._lock = plan, batch, 0, threading.Lock()

    def take(self) -> Plan:
        with self._lock:
            self._next += 1
            return self._plan((self._next - 1) % self._batch)


def sandbox_reward(environments: list[SandboxEnvironment], **kwargs: Any) -> list[float | None]:
    """TRL reward function: each rollout's reward, read in its sandbox when the trainer scored
    it; None (TRL's unscorable: advantage 0, never 0) for a rollout the trainer dropped and for
    every rollout of its group (``EngineGRPOTrainer._generate`` marks them)."""
    return [e.sample.reward if e.trained else None for e in environments]
