"""``RecoverableSandboxEnv``: a Gymnasium env over a real container, with prefix-consistent recovery.

One bash command per step, mini-swe-agent style. When step k+1 hits an infrastructure
failure, the effects of that action are unknowable, so it is never retried: the env fences
the dead sandbox, restores the newest ready checkpoint j <= k (boundary 0's own when the
policy took one, else the initial state, j = 0: a fresh sandbox plus the task's setup) and returns the observation of boundary j with
``info["belayer"]["rollback"] = {"to_step": j, "reason": ...}``. The agent rolls its context
back to prefix j and regenerates from there. Infra error text never reaches an observation;
it is kept, labelled, in ``env.trajectory``.

``info`` holds no timings, so the env stays deterministic for ``check_env``; timings and
events live in ``env.trajectory``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import docker
import gymnasium as gym

from belayer_core.errors import InfraError, SandboxLost, UsageError
from belayer_env.common.phases import PhaseHook, PhaseHooks
from belayer_env.env.checkpointing import Checkpointer
from belayer_env.env.config import SUBMIT_MARKER, EnvConfig, with_overrides
from belayer_env.env.episode import EpisodeSandbox
from belayer_env.env.forking import fork_env
from belayer_env.env.policy import CheckpointPolicy, PolicyName, make_policy
from belayer_env.env.recovery import Recovery
from belayer_env.env.rewards import Reward, ZeroReward
from belayer_env.env.spaces import AnyText
from belayer_env.env.trajectory import InfraEvent, StepRecord, Trajectory
from belayer_env.env.turns import IdleRecovery, OneThread
from belayer_env.forks.pool import ForkPool
from belayer_env.restore.cleanup import wait_cleaned
from belayer_env.restore.spare import RestoreSpare, kept_filled
from belayer_env.sandbox.config import ResetOptions, SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.docker_api import connect
from belayer_env.sandbox.removal import wait_removed
from belayer_env.store.manifest import Checkpoint

OWN_EXITS_TO_END = 2
"""An action from the same boundary that ends the sandbox from inside this often is the agent's outcome."""
StepResult = tuple[str, float, bool, bool, dict]


class RecoverableSandboxEnv(gym.Env[str, str]):
    """The env (module docstring). It holds its parts: ``episode`` (the sandbox under its
    name), ``checkpointer`` (captures), ``recovery`` (rollbacks: the one place that decides
    what a rollback restores into), ``idle`` (deaths while the agent generates)."""

    metadata = {"render_modes": []}

    def __init__(self, config: EnvConfig | None = None, *,
                 checkpoint_policy: PolicyName | CheckpointPolicy = "adaptive",
                 reward: Reward | None = None, client: docker.DockerClient | None = None,
                 **overrides: Any):
        config = with_overrides(config, overrides)  # validated like a fresh config: ConfigError
        self.config = config
        self.policy = make_policy(checkpoint_policy)
        self.reward_fn: Reward = reward or ZeroReward()
        self.client = client or connect(config.sandbox.docker_host)
        limit = config.sandbox.max_output_bytes * 4 + 1024  # decoded text: up to 4 chars' worth per byte
        self.observation_space = AnyText(max_length=max(limit, 1_000_000))
        self.action_space = AnyText(max_length=1_000_000)
        self.trajectory = Trajectory()
        hooks = PhaseHooks()  # called at the mechanism's named phases (``add_phase_hook``)
        self.episode = EpisodeSandbox(self.client, config.sandbox, hooks)
        self.checkpointer = Checkpointer(self.policy, self._record, hooks, directory=config.checkpoint_dir,
                                         keep=config.keep_checkpoints, runtime=config.runtime)
        self.recovery = Recovery(config, self.episode, self.checkpointer, self.policy, self._record)
        self.idle = IdleRecovery(self.client, self.episode, enabled=config.recover_while_idle,
                                 boundary=lambda: len(self.trajectory.steps), recover=self._recover_idle)
        self.fork_pool: ForkPool | None = None
        if config.fork_pool:
            self.checkpointer.on_published.append(self._prepare_forks)
        self._done = True
        self._last_return = time.monotonic()
        self.last_result: dict[str, Any] = {}
        """The sandbox's raw result of the last committed step (output, returncode)."""
        self._one_thread = OneThread()
        self._own_exits: dict[int, int] = {}  # boundary -> times an action from it ended the sandbox

    @property
    def sandbox(self) -> DockerSandbox | None:
        """The episode's sandbox (``episode`` holds it: a reset, a rollback or a resume replaces it)."""
        return self.episode.sandbox

    @property
    def name(self) -> str:
        """The episode's sandbox name (every container of the episode carries it)."""
        return self.episode.name

    @property
    def restore_spare(self) -> RestoreSpare | None:
        """The container created ahead for the next restore (``EnvConfig.restore_spare``)."""
        return self.recovery.spare

    @contextlib.contextmanager
    def _env_turn(self, what: str) -> Iterator[None]:
        """One thread at a time; with ``recover_while_idle``, the sandbox is watched from
        each return until the next call (which first waits for a restore begun meanwhile)."""
        with self._one_thread(what):
            self.idle.take_turn()
            try:
                yield
            finally:
                self.idle.give_turn(None if self._done else self.sandbox)

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        """Fresh sandbox (``options``: ``task`` text, ``setup`` command(s), ``image``)."""
        with self._env_turn("reset"):
            self.idle.take_outcome()  # a new episode: the old one's restore is moot
            return self._reset(seed, options)

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict]:
        super().reset(seed=seed)
        started = time.monotonic()
        opts = ResetOptions.parse(options)  # before anything is torn down: a bad option changes nothing
        self._own_exits = {}
        self._done = True  # until the new sandbox is ready
        self.checkpointer.reset()
        episode = self.episode
        episode.fence(wait_removed=False)
        episode.sandbox = None
        episode.setup = opts.setup_commands
        episode.config = SandboxConfig.merged(self.config.sandbox, {"image": opts.image} if opts.image else {})
        self.trajectory = Trajectory(task=opts.task)
        self.policy.observe_rollback(0)
        episode.name = episode.new_name()
        for attempt in range(self.config.recovery_attempts):
            try:
                episode.sandbox = episode.initial_state()
                break
            except InfraError:
                if attempt + 1 == self.config.recovery_attempts:
                    raise
        self._done = False
        if self.fork_pool is not None:
            self.fork_pool.prepare(None)  # the last episode's checkpoints are gone
        self.refill_fork_pool()
        self.recovery.refill_spare()
        observe_reset = getattr(self.policy, "observe_reset", None)  # a policy of an older protocol may lack it
        if observe_reset is not None:
            observe_reset(time.monotonic() - started)
        self.checkpointer.after_step(self.sandbox, 0)  # boundary 0, if the policy finds it worth it
        self._last_return = time.monotonic()
        return self.trajectory.task, {"belayer": {"step": 0}}

    def step(self, action: str) -> StepResult:
        return self.step_command(action)

    def step_command(self, action: str, *, cwd: str = "", timeout: float | None = None,
                     checkpoint: bool = True) -> StepResult:
        """``step`` with mini-swe-agent's per-call ``cwd``/``timeout``; ``checkpoint=False``
        keeps this boundary out of the checkpoint policy (e.g. mid-way through a message)."""
        with self._env_turn("step"):
            outcome = self.idle.take_outcome()
            if outcome is not None:
                if isinstance(outcome.result, BaseException):
                    raise outcome.result  # every restore attempt failed: as a step's own failure would
                rollback = outcome.result[4]["belayer"]["rollback"]
                if outcome.moved_back:  # an older boundary: the agent regenerates from there
                    outcome.result[4]["belayer"]["recovered_while_idle"] = rollback
                    return outcome.result
            result = self._step(action, cwd, timeout, checkpoint)
            if outcome is not None:  # restored to this very boundary: the action ran once, on the restored sandbox
                result[4]["belayer"]["recovered_while_idle"] = rollback
            return result

    def _step(self, action: str, cwd: str, timeout: float | None, checkpoint: bool) -> StepResult:
        if self._done or self.sandbox is None:
            raise UsageError("the episode is over (or was never started): call reset() first")
        if not isinstance(action, str):
            raise UsageError(f"action must be a str (one bash command), got {type(action).__name__}")
        called = time.monotonic()
        gen_s = called - self._last_return
        k = len(self.trajectory.steps)
        self.checkpointer.before_step(k)
        try:
            result = self.sandbox.execute(action, cwd=cwd, timeout=timeout)
            if (result["returncode"] >= 128 or result["returncode"] == 126) and not result.get("timed_out"):
                # killed by a signal (or could not start: 126): it may have died *with* its
                # container; one more exec asks before the agent is shown that exit code
                self.sandbox.confirm_alive(f"sandbox {self.name}: liveness probe")
            output = result["output"]
            submitted = result["returncode"] == 0 and _first_line(output) == SUBMIT_MARKER
            reward = 0.0
            if submitted:
                submission = output.lstrip().split("\n", 1)[1] if "\n" in output.lstrip() else ""
                reward = float(self.reward_fn(self.sandbox, self.trajectory, submission))
        except InfraError as e:
            code = self.episode.own_exit() if isinstance(e, SandboxLost) else None
            if code is not None:
                self._own_exits[k] = self._own_exits.get(k, 0) + 1
                self._record("sandbox_exited", at_step=k, error=e, exit_code=code)
                if self._own_exits[k] >= OWN_EXITS_TO_END:
                    return self._ended_by_action(action, k, code, time.monotonic() - called, gen_s)
            return self._recover(e, k)
        exec_s = time.monotonic() - called
        self.last_result = result
        observation = self.config.observation_template.format(returncode=result["returncode"], output=output)
        self.trajectory.commit(StepRecord(
            step=k + 1, action=action, observation=observation, returncode=result["returncode"],
            exec_s=exec_s, gen_s=gen_s, regenerated=self.trajectory.recovered))
        self.policy.observe_step(exec_s, gen_s)
        truncated = self.config.max_steps is not None and k + 1 >= self.config.max_steps and not submitted
        self._done = submitted or truncated
        info: dict[str, Any] = {"belayer": {"step": k + 1}, "returncode": result["returncode"]}
        if result.get("timed_out"):
            info["timed_out"] = True
        if submitted:
            info["submission"] = submission
        elif not truncated and checkpoint:
            self.checkpointer.after_step(self.sandbox, k + 1)  # runs during the LLM's next generation
        if (failed := self.checkpointer.take_failure()) is not None:  # a capture collected in this step failed
            info["belayer"]["checkpoint_failed"] = failed
        self._last_return = time.monotonic()
        return observation, reward, submitted, truncated, info

    def fork(self, n: int) -> list[RecoverableSandboxEnv]:
        """``n`` independent envs at this env's current boundary (see ``belayer_env.fork``)."""
        with self._env_turn("fork"):
            outcome = self.idle.outcome
            if outcome is not None and (isinstance(outcome.result, BaseException) or outcome.moved_back):
                raise SandboxLost(f"sandbox {self.name} died while idle and is not at the agent's boundary any "
                                  "more: call step() to receive the rollback, then fork")

            return fork_env(self, n, RecoverableSandboxEnv)

    def refill_fork_pool(self) -> None:
        """Top up ``fork_pool`` containers for this sandbox in the background (config
        ``fork_pool``; a pool made for another image or settings is replaced)."""
        self.fork_pool = kept_filled(self.fork_pool, bool(self.config.fork_pool), self.sandbox,
                                     lambda sb: ForkPool(sb, self.config.fork_pool, new_name=self.episode.new_name))

    def _prepare_forks(self, checkpoint: Checkpoint) -> None:
        """A checkpoint was published: the fork pool verifies what forks of it need
        (``fork_ahead``), holding it instead of the previous checkpoint's."""
        pool = self.fork_pool
        if pool is not None and checkpoint.sandbox == self.name:
            pool.prepare(checkpoint)

    def add_phase_hook(self, hook: PhaseHook) -> Callable[[], None]:
        """Call ``hook(phase)`` at every named ``Phase`` of this env's captures and restores
        (boundary 0's fresh sandbox included: ``created``, ``verified``); returns a function
        that removes it. It runs on the thread doing the work; raising there fails that
        capture or restore as if its process had crashed (how fault injection uses it)."""
        return self.checkpointer.hooks.add(hook)

    def settle(self, timeout: float = 60.0) -> None:
        """Wait (bounded) for a capture in flight, e.g. before using ``self.sandbox`` directly."""
        with self._env_turn("settle"):
            self.checkpointer.settle(len(self.trajectory.steps), timeout)

    def close(self) -> None:
        """Remove the sandbox container and every checkpoint this env made (idempotent)."""
        with self._env_turn("close"):
            self.idle.take_outcome()
            if self.fork_pool is not None:
                self.fork_pool.close()
            self.fork_pool = None
            self.recovery.close()
            self.checkpointer.close()
            self.episode.fence()
            wait_cleaned()  # the restores' spent copies, deleted on threads
            wait_removed()  # the containers recoveries fenced, removed on threads
            self.episode.sandbox = None
            self._done = True
            super().close()

    # ------------------------------------------------------------------ the env's half of a rollback

    def _recover(self, error: InfraError, k: int, *, while_idle: bool = False) -> StepResult:
        """``recovery`` restores boundary j <= k; the trajectory goes back to j and the agent
        is told (``info["belayer"]["rollback"]``). The failed action is never retried."""
        try:
            restored = self.recovery.rollback(error, k)
        except InfraError:
            self._done = True  # every attempt failed
            raise
        j = restored.step
        self.trajectory.rollback(j, at_step=k, error=error, recovery_s=time.monotonic() - restored.detected,
                                 while_idle=while_idle,
                                 recovery_parts={n: round(v, 4) for n, v in restored.parts.items()})
        if not while_idle:  # while idle the agent's generation goes on: its interval is not reset
            self._last_return = time.monotonic()
        observation = self.trajectory.observation_at(j)
        info = {"belayer": {"step": j, "rollback": {"to_step": j, "reason": type(error).__name__}}}
        return (self.trajectory.task if observation is None else observation), 0.0, False, False, info

    def _recover_idle(self, error: SandboxLost, k: int) -> tuple[StepResult, InfraEvent]:
        """``_recover`` for ``idle``: its step result and its rollback event."""
        result = self._recover(error, k, while_idle=True)
        return result, next(e for e in reversed(self.trajectory.events) if e.kind == "rollback")

    def _record(self, kind: str, at_step: int, error: BaseException | None = None, **extra: Any) -> None:
        self.trajectory.record(kind, at_step, error, **extra)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ an action that ends the sandbox

    def _ended_by_action(self, action: str, k: int, code: int, exec_s: float,
                         gen_s: float) -> StepResult:
        """Actions from boundary ``k`` ended the sandbox from inside again: that is the
        agent's outcome (terminal), not an infrastructure failure to roll back forever."""
        self.checkpointer.before_fence(k)
        self.episode.fence()
        self.episode.sandbox = None
        self._done = True
        output = f"[belayer: the command ended the sandbox itself (its init exited with code {code}); the episode is over]\n"
        observation = self.config.observation_template.format(returncode=code, output=output)
        self.trajectory.commit(StepRecord(step=k + 1, action=action, observation=observation, returncode=None,
                                          exec_s=exec_s, gen_s=gen_s, regenerated=self.trajectory.recovered))
        info = {"belayer": {"step": k + 1, "sandbox_exited": {"exit_code": code, "times": self._own_exits[k]}}}
        return observation, 0.0, True, False, info


def _first_line(output: str) -> str:
    lines = output.lstrip().splitlines()
    return lines[0].strip() if lines else ""
