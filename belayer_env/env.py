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
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import docker
import gymnasium as gym
from pydantic import ConfigDict, Field

from belayer.errors import ConfigError, InfraError, SandboxLost, UsageError
from belayer.procfs import read_stat
from belayer_env.background import Background
from belayer_env.checkpoint.manifest import Checkpoint
from belayer_env.checkpoint.restore import wait_cleaned
from belayer_env.checkpointing import Checkpointer
from belayer_env.config import ResetOptions, SandboxConfig, StrictModel
from belayer_env.deathwatch import DeathWatch
from belayer_env.docker_api import connect
from belayer_env.fence import fence, remove_in_background, sandbox_containers, wait_removed
from belayer_env.fence import kill as fence_kill
from belayer_env.fork_pool import ForkPool, RestoreSpare
from belayer_env.phases import Phase, PhaseHook
from belayer_env.policy import CheckpointPolicy, PolicyName, make_policy
from belayer_env.rewards import Reward, ZeroReward
from belayer_env.sandbox import DockerSandbox
from belayer_env.spaces import AnyText
from belayer_env.trajectory import InfraEvent, StepRecord, Trajectory

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
OWN_EXITS_TO_END = 2
"""An action from the same boundary that ends the sandbox from inside this often is the agent's outcome."""
OWN_EXIT_WAIT_S = 5.0
OBSERVATION_TEMPLATE = "<returncode>{returncode}</returncode>\n<output>\n{output}</output>"
_Pool = TypeVar("_Pool", bound=ForkPool)  # what an env keeps filled: a ForkPool or a RestoreSpare


class EnvConfig(StrictModel):
    """How the env runs, recovers and formats (the sandbox has its own config)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    observation_template: str = OBSERVATION_TEMPLATE
    max_steps: int | None = Field(default=None, ge=1)
    """Truncate the episode after this many committed steps (None: never)."""
    checkpoint_dir: str | None = None
    """Checkpoint store directory (None: a private temporary one, removed at close)."""
    keep_checkpoints: int = Field(default=3, ge=1)
    runtime: bool = True
    """Capture process state with CRIU (False: file-system-only checkpoints)."""
    allow_degraded: bool = False
    """Accept a file-system-only restore when the runtime cannot be restored (reported)."""
    recovery_attempts: int = Field(default=4, ge=1)
    """Restore attempts per failure before the episode is given up (the error is raised)."""
    pending_wait_s: float = Field(default=30.0, ge=0)
    """On failure, how long to wait for a capture still being written (it predates the fault)."""
    standby: bool = False
    """Keep the newest checkpoint pre-restored in a frozen standby when the policy agrees
    (memory, cost): a rollback onto it is fence + thaw + verify (checkpoint/standby.py)."""
    fork_pool: int = Field(default=0, ge=0, le=64)
    """Keep this many fork containers created ahead, refilled in the background after
    ``reset`` and each ``fork`` (``belayer_env.fork_pool``): ``fork(n)`` then only starts
    them. Each costs a created container (and its disk cap's loop mount). 0: off."""
    restore_spare: bool = False
    """Keep one container created ahead for the next restore, refilled in the background
    after ``reset`` and each rollback (``fork_pool.RestoreSpare``): a rollback without a
    standby skips Docker's create. Costs a created container (no memory)."""
    recover_while_idle: bool = False
    """Watch the sandbox while the agent holds the turn (generates its next action) and, when
    it dies then, restore the newest ready checkpoint j at once, in the background. The next
    call finds it restored: ``step`` runs its action on it when j is the agent's boundary
    (that action never ran, so nothing is replayed), else returns the rollback to j without
    waiting for a restore. Needs the container's init pid visible here (``deathwatch``)."""


class _OneThread:
    """Admits one thread at a time into the env; another one gets ``UsageError`` at once.

    Two threads in one env would interleave execs with captures (an exec racing a freeze
    wedges the container) and corrupt the boundary count; failing fast says so plainly.
    Re-entry from the same thread (``step`` -> ``step_command``) is fine.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._holder = ""

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise UsageError(f"{what}() called while {self._holder} runs on another thread: an env is used by "
                             "one thread at a time (give each thread its own env)")
        self._depth += 1
        if self._depth == 1:
            self._holder = f"{what}() of thread {threading.current_thread().name!r}"
        try:
            yield
        finally:
            self._depth -= 1
            self._lock.release()


class RecoverableSandboxEnv(gym.Env[str, str]):
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
        self.checkpointer = Checkpointer(self.policy, self._record, directory=config.checkpoint_dir,
                                         keep=config.keep_checkpoints, runtime=config.runtime,
                                         allow_degraded=config.allow_degraded, standby=config.standby)
        self.sandbox: DockerSandbox | None = None
        self.fork_pool: ForkPool | None = None
        if config.fork_pool:
            self.checkpointer.on_published.append(self._prepare_forks)
        self.restore_spare: RestoreSpare | None = None
        self.name = ""
        self._episode_config = config.sandbox
        self._setup: list[str] = []
        self._done = True
        self._last_return = time.monotonic()
        self.last_result: dict[str, Any] = {}
        """The sandbox's raw result of the last committed step (output, returncode)."""
        self._one_thread = _OneThread()
        self._own_exits: dict[int, int] = {}  # boundary -> times an action from it ended the sandbox
        self._idle_lock = threading.Lock()
        self._agent_turn = False  # between the env's return and the agent's next call
        self._idle_recovery: Background | None = None
        self._idle_outcome: _IdleOutcome | None = None  # for the next step
        self._watch = DeathWatch(self.client, self._died_while_idle) if config.recover_while_idle else None

    @contextlib.contextmanager
    def _env_turn(self, what: str) -> Iterator[None]:
        """One thread at a time; with ``recover_while_idle``, the sandbox is watched from
        each return until the next call (which first waits for a restore begun meanwhile)."""
        with self._one_thread(what):
            self._take_turn()
            try:
                yield
            finally:
                self._give_turn()

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        """Fresh sandbox (``options``: ``task`` text, ``setup`` command(s), ``image``)."""
        with self._env_turn("reset"):
            self._idle_outcome = None  # a new episode: the old one's restore is moot
            return self._reset(seed, options)

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict]:
        super().reset(seed=seed)
        started = time.monotonic()
        opts = ResetOptions.parse(options)  # before anything is torn down: a bad option changes nothing
        self._own_exits = {}
        self._done = True  # until the new sandbox is ready
        self.checkpointer.reset()
        self._fence(wait_removed=False)
        self.sandbox = None
        self._setup = opts.setup_commands
        self._episode_config = SandboxConfig.merged(self.config.sandbox, {"image": opts.image} if opts.image else {})
        self.trajectory = Trajectory(task=opts.task)
        self.policy.observe_rollback(0)
        self.name = self._new_name()
        for attempt in range(self.config.recovery_attempts):
            try:
                self.sandbox = self._initial_state()
                break
            except InfraError:
                if attempt + 1 == self.config.recovery_attempts:
                    raise
        self._done = False
        if self.fork_pool is not None:
            self.fork_pool.prepare(None)  # the last episode's checkpoints are gone
        self.refill_fork_pool()
        self._refill_restore_spare()
        observe_reset = getattr(self.policy, "observe_reset", None)  # a policy of an older protocol may lack it
        if observe_reset is not None:
            observe_reset(time.monotonic() - started)
        self.checkpointer.after_step(self.sandbox, 0)  # boundary 0, if the policy finds it worth it
        self._last_return = time.monotonic()
        return self.trajectory.task, {"belayer": {"step": 0}}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return self.step_command(action)

    def step_command(self, action: str, *, cwd: str = "", timeout: float | None = None,
                     checkpoint: bool = True) -> tuple[str, float, bool, bool, dict]:
        """``step`` with mini-swe-agent's per-call ``cwd``/``timeout``; ``checkpoint=False``
        keeps this boundary out of the checkpoint policy (e.g. mid-way through a message)."""
        with self._env_turn("step"):
            outcome, self._idle_outcome = self._idle_outcome, None
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

    def _step(self, action: str, cwd: str, timeout: float | None,
              checkpoint: bool) -> tuple[str, float, bool, bool, dict]:
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
                self._confirm_alive()
            output = result["output"]
            submitted = result["returncode"] == 0 and _first_line(output) == SUBMIT_MARKER
            reward = 0.0
            if submitted:
                submission = output.lstrip().split("\n", 1)[1] if "\n" in output.lstrip() else ""
                reward = float(self.reward_fn(self.sandbox, self.trajectory, submission))
        except InfraError as e:
            code = self._own_exit() if isinstance(e, SandboxLost) else None
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
        self._last_return = time.monotonic()
        return observation, reward, submitted, truncated, info

    def fork(self, n: int) -> list[RecoverableSandboxEnv]:
        """``n`` independent envs at this env's current boundary (see ``belayer_env.fork``)."""
        with self._env_turn("fork"):
            from belayer_env.forking import fork_env

            if self._idle_outcome is not None and (isinstance(self._idle_outcome.result, BaseException)
                                                   or self._idle_outcome.moved_back):
                raise SandboxLost(f"sandbox {self.name} died while idle and is not at the agent's boundary any "
                                  "more: call step() to receive the rollback, then fork")

            return fork_env(self, n)

    def refill_fork_pool(self) -> None:
        """Top up ``fork_pool`` containers for this sandbox in the background (config
        ``fork_pool``; a pool made for another image or settings is replaced)."""
        self.fork_pool = self._refilled(self.fork_pool, bool(self.config.fork_pool),
                                        lambda sb: ForkPool(sb, self.config.fork_pool, new_name=self._new_name))

    def _prepare_forks(self, checkpoint: Checkpoint) -> None:
        """A checkpoint was published: the fork pool verifies what forks of it need
        (``fork_ahead``), holding it instead of the previous checkpoint's."""
        pool = self.fork_pool
        if pool is not None and checkpoint.sandbox == self.name:
            pool.prepare(checkpoint)

    def _refill_restore_spare(self) -> None:
        """The same for the restore spare (config ``restore_spare``), named apart from any
        episode's sandbox: it outlives resets (a new name each)."""
        self.restore_spare = self._refilled(
            self.restore_spare, self.config.restore_spare,
            lambda sb: RestoreSpare(sb, new_name=lambda: f"{self._new_name()}-spare"))

    def _refilled(self, pool: _Pool | None, wanted: bool, make: Callable[[DockerSandbox], _Pool]) -> _Pool | None:
        if not wanted or self.sandbox is None:
            return pool
        if pool is not None and not pool.serves(self.sandbox):
            pool.close()
            pool = None
        if pool is None:  # not ``pool or``: an empty pool is falsy (``len``)
            pool = make(self.sandbox)
        pool.fill()
        return pool

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
            self._idle_outcome = None
            for pool in (self.fork_pool, self.restore_spare):
                if pool is not None:
                    pool.close()
            self.fork_pool = self.restore_spare = None
            self.checkpointer.close()
            self._fence()
            wait_cleaned()  # the restores' spent copies, deleted on threads
            wait_removed()  # the containers recoveries fenced, removed on threads
            self.sandbox = None
            self._done = True
            super().close()

    # ------------------------------------------------------------------ an action that ends the sandbox

    def _own_exit(self) -> int | None:
        """The container's exit code when its init exited by itself (e.g. the action ran
        ``kill -TERM 1``): not killed by a signal (>= 128), not OOM-killed. None otherwise,
        including a container still running (a broken transport, say)."""
        if self.sandbox is None:
            return None
        deadline = time.monotonic() + OWN_EXIT_WAIT_S
        try:
            while True:
                state = self.client.api.inspect_container(self.sandbox.container_id)["State"]
                if not state.get("Running"):
                    break
                init = read_stat(state.get("Pid") or 0)
                if (init is not None and init.running) or time.monotonic() > deadline:
                    return None
                time.sleep(0.02)  # the init is exiting: Docker records the exit a moment later
        except Exception:  # noqa: BLE001 - gone or unreadable: no evidence, treat as infra
            return None
        code = state.get("ExitCode")
        if state.get("OOMKilled") or not isinstance(code, int) or not 0 <= code < 128:
            return None
        return code

    def _ended_by_action(self, action: str, k: int, code: int, exec_s: float,
                         gen_s: float) -> tuple[str, float, bool, bool, dict]:
        """Actions from boundary ``k`` ended the sandbox from inside again: that is the
        agent's outcome (terminal), not an infrastructure failure to roll back forever."""
        self.checkpointer.before_fence(k)
        self._fence()
        self.sandbox = None
        self._done = True
        output = f"[belayer: the command ended the sandbox itself (its init exited with code {code}); the episode is over]\n"
        observation = self.config.observation_template.format(returncode=code, output=output)
        self.trajectory.commit(StepRecord(step=k + 1, action=action, observation=observation, returncode=None,
                                          exec_s=exec_s, gen_s=gen_s, regenerated=self.trajectory.recovered))
        info = {"belayer": {"step": k + 1, "sandbox_exited": {"exit_code": code, "times": self._own_exits[k]}}}
        return observation, 0.0, True, False, info

    # ------------------------------------------------------------------ recovery

    def _recover(self, error: InfraError, k: int, *, while_idle: bool = False) -> tuple[str, float, bool, bool, dict]:
        """Fence, restore boundary j <= k, roll the trajectory back; never retry the action."""
        detected = time.monotonic()
        self.policy.observe_failure()
        self.checkpointer.before_fence(k)  # a CRIU dump still running would wedge the fence
        dead = self._kill_sandbox()
        parts = {"fence": time.monotonic() - detected}
        try:
            return self._restore_after(error, k, detected, set(dead), while_idle, parts)
        finally:
            # removed once the rollback is done: deleting a big dead layer beside the restore
            # slowed a heavy one by ~0.1 s (benchmarks/checkpoint_bench.py, prestaged_lost)
            remove_in_background(self.client, dead)

    def _restore_after(self, error: InfraError, k: int, detected: float, fenced: set[str], while_idle: bool,
                       parts: dict[str, float]) -> tuple[str, float, bool, bool, dict]:
        t = time.monotonic()
        if self._name_blocked(fenced):
            # a container of this name cannot be removed (e.g. wedged by a hung CRIU dump):
            # checkpoints restore under this name, so only boundary 0, under a new name, is left
            self._record("restore_failed", at_step=k, error=SandboxLost(f"cannot fence {self.name}"))
            self.checkpointer.discard_after(-1)  # a checkpoint of boundary 0 would restore under it too
            self.name = self._new_name()
        parts["fence"] = parts.get("fence", 0.0) + time.monotonic() - t
        last: InfraError = error
        restored: tuple[DockerSandbox, int] | None = None
        for _ in range(self.config.recovery_attempts):
            try:
                restored = self.checkpointer.restore(k, client=self.client, wait_s=self.config.pending_wait_s,
                                                     attempts=self.config.recovery_attempts, spare=self.restore_spare,
                                                     parts=parts)
                if restored is None:
                    t = time.monotonic()
                    self._fence(wait_removed=False)  # a failed restore may have left a container of this name
                    restored = (self._initial_state(), 0)
                    parts["initial"] = parts.get("initial", 0.0) + time.monotonic() - t
                break
            except InfraError as e:  # the fresh sandbox failed too: fence it and try again
                last = e
                self._record("restore_failed", at_step=k, error=e)
                self._fence(wait_removed=False)
        if restored is None:
            self._done = True
            raise last
        self.sandbox, j = restored
        if self.restore_spare is not None:  # the restored sandbox is made as the one it was made for
            self.restore_spare.fill()
        self.checkpointer.discard_after(j)
        self.policy.observe_rollback(j)
        self.trajectory.rollback(j, at_step=k, error=error, recovery_s=time.monotonic() - detected,
                                 while_idle=while_idle, recovery_parts={n: round(v, 4) for n, v in parts.items()})
        self._last_return = time.monotonic()
        observation = self.trajectory.observation_at(j)
        info = {"belayer": {"step": j, "rollback": {"to_step": j, "reason": type(error).__name__}}}
        return (self.trajectory.task if observation is None else observation), 0.0, False, False, info

    def _confirm_alive(self) -> None:
        """A command killed by a signal (or that could not start: 126) may have died *with* its
        container: Docker reports the container running until its init has finished exiting,
        so ask with one more exec (which fails once the init is exiting) before showing the
        agent that exit code."""
        probe = self.sandbox.execute("true", timeout=10)
        if probe["returncode"] != 0:
            raise SandboxLost(f"sandbox {self.name}: liveness probe exited {probe['returncode']}")

    def _initial_state(self) -> DockerSandbox:
        """Boundary 0: a fresh container from the episode's image plus the task's setup."""
        hook = self.checkpointer.hooks
        sandbox = DockerSandbox(self._episode_config, name=self.name, client=self.client)
        try:
            hook(Phase.CREATED)
            for command in self._setup:
                result = sandbox.execute(command)
                if result["returncode"] != 0:
                    raise UsageError(f"task setup failed (exit {result['returncode']}): {command!r}\n{result['output'][-2000:]}")
            hook(Phase.VERIFIED)
        except BaseException:
            with contextlib.suppress(Exception):
                sandbox.close()
            raise
        return sandbox

    def _fence(self, *, wait_removed: bool = True) -> None:
        """Kill and remove every container of this episode's sandbox name (the dead one too).

        ``wait_removed=False`` (recovery, reset): return once they are dead and the name is
        free, their removal left to a thread (a big writable layer takes a second or more to
        delete, on the rollback's critical path before; ``belayer gc`` reaps what a dying
        process leaves). Not ``sandbox.close()`` first: on a wedged container that blocks in
        Docker; the fence thaws it before it asks Docker for anything about it."""
        if self.name:
            with contextlib.suppress(Exception):
                fence(self.client, self.name, background=not wait_removed)
        elif self.sandbox is not None:
            with contextlib.suppress(Exception):
                self.sandbox.close()

    def _kill_sandbox(self) -> list[str]:
        """``_fence`` without the removal: kill and rename aside (the name is free); returns
        what is left to ``remove_in_background``. Dead in the kernel's view is enough: Docker's
        state says so 50-150 ms later, a wait the rollback need not make."""
        if not self.name:
            return []
        try:
            return fence_kill(self.client, self.name, docker_view=False)
        except Exception:  # noqa: BLE001 - as _fence: the restore's own fence tries again
            return []

    def _new_name(self) -> str:
        return f"{self._episode_config.name_prefix}-env-{uuid.uuid4().hex[:12]}"

    def _name_blocked(self, fenced: set[str]) -> bool:
        """A container of this sandbox still runs or holds its name after the fence (``fenced``
        ones are dead and renamed aside, whatever Docker's state says yet; their removal maybe
        still under way)."""
        try:
            return any(c.get("State") not in ("exited", "dead", "created", "removing")
                       or f"/{self.name}" in (c.get("Names") or ())
                       for c in sandbox_containers(self.client, self.name, by_name=True) if c["Id"] not in fenced)
        except Exception:  # noqa: BLE001 - daemon trouble: the restore attempts will report it
            return False

    def _record(self, kind: str, at_step: int, error: BaseException | None = None, **extra: Any) -> None:
        self.trajectory.record(kind, at_step, error, **extra)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ deaths while the agent generates

    def _give_turn(self) -> None:
        if self._watch is None or self._done or self.sandbox is None:
            return
        with self._idle_lock:
            self._agent_turn = True
            self._watch.arm(self.sandbox.container_id)

    def _take_turn(self) -> None:
        """The agent calls again: stop watching; a restore begun meanwhile is waited for (its
        wait is recorded on its rollback event: the part of it the agent's time did not hide)."""
        if self._watch is None:
            return
        with self._idle_lock:
            self._agent_turn = False
            self._watch.disarm()
            recovery, self._idle_recovery = self._idle_recovery, None
        if recovery is not None:
            t0 = time.monotonic()
            recovery.join()  # bounded: the restore's own attempts and waits are
            if self._idle_outcome is not None and self._idle_outcome.event is not None:
                self._idle_outcome.event.waited_s = time.monotonic() - t0

    def _died_while_idle(self, generation: int) -> None:
        """On the watch's thread: the init died while the agent generates; restore now."""
        with self._idle_lock:
            if (not self._agent_turn or self._idle_recovery is not None or self._watch is None
                    or generation != self._watch.generation):
                return
            self._idle_recovery = Background(self._recover_idle, name=f"belayer-idle-restore-{self.name}")

    def _recover_idle(self) -> None:
        k = len(self.trajectory.steps)
        if self._own_exit() is not None:
            return  # its init exited by itself (a background job of an action): the next step judges that
        error = SandboxLost(f"sandbox {self.name} died while the agent was generating its next action")
        last_return = self._last_return  # the agent's generation goes on: its interval is not reset
        event = None
        try:
            result: tuple | BaseException = self._recover(error, k, while_idle=True)
            event = next(e for e in reversed(self.trajectory.events) if e.kind == "rollback")  # this one's
        except Exception as e:  # noqa: BLE001 - raised by the agent's next step, as the step's own recovery would
            result = e
        finally:
            self._last_return = last_return
        self._idle_outcome = _IdleOutcome(at_step=k, result=result, event=event)


class _IdleOutcome:
    """What a restore begun while the agent generated left for its next step: the rollback's
    step result (observation of boundary j, info), or the error that ended the episode."""

    def __init__(self, at_step: int, result: tuple | BaseException, event: InfraEvent | None):
        self.at_step = at_step
        self.result = result
        self.event = event  # the rollback event (its ``waited_s`` is filled in by the next call)

    @property
    def moved_back(self) -> bool:
        """Restored to a boundary older than the agent's (the step result is a rollback to report)."""
        return not isinstance(self.result, BaseException) and self.result[4]["belayer"]["step"] < self.at_step


def with_overrides(config: EnvConfig | None, overrides: dict[str, Any]) -> EnvConfig:
    """``config`` (default: ``EnvConfig()``) with keyword overrides (``gym.make`` kwargs): names of
    ``EnvConfig`` fields set the env, every other name the sandbox; all validated (``ConfigError``)."""
    if config is not None and not isinstance(config, EnvConfig):
        raise ConfigError(f"config must be an EnvConfig, got {type(config).__name__}")
    config = config or EnvConfig()
    if not overrides:
        return config
    env_fields = {k: v for k, v in overrides.items() if k in EnvConfig.model_fields}
    base = env_fields.pop("sandbox", config.sandbox)
    if isinstance(base, dict):
        base = SandboxConfig(**base)
    sandbox = SandboxConfig.merged(base, {k: v for k, v in overrides.items() if k not in EnvConfig.model_fields})
    return EnvConfig(**{**dict(config), **env_fields, "sandbox": sandbox})


def _first_line(output: str) -> str:
    lines = output.lstrip().splitlines()
    return lines[0].strip() if lines else ""
