"""What the env does when its sandbox fails: fence it, restore the newest ready boundary j <= k
into a fresh container (or boundary 0: a new one plus the task's setup), roll the trajectory
back to j. The failed action is never retried. A mixin of ``RecoverableSandboxEnv``: the
env's state (its sandbox, checkpointer, trajectory, policy) is the env's own."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

from belayer_core.errors import InfraError, SandboxLost, UsageError
from belayer_env.phases import Phase
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.fence import fence, remove_in_background, sandbox_containers
from belayer_env.sandbox.fence import kill as fence_kill


class Rollback:
    """Recovery of ``RecoverableSandboxEnv`` (``self`` is the env)."""

    def _recover(self, error: InfraError, k: int, *, while_idle: bool = False) -> tuple[str, float, bool, bool, dict]:
        """Fence, restore boundary j <= k, roll the trajectory back; never retry the action."""
        detected = time.monotonic()
        self.policy.observe_failure()
        self.checkpointer.before_fence(k)  # a CRIU dump still running would wedge the fence
        # a standby ready for this rollback fences the sandbox itself, through the kernel (a
        # failed promotion falls back to a restore, which fences first as well)
        standby = self.checkpointer.standby_for(k)
        dead = [] if standby else self._kill_sandbox()
        parts = {"fence": time.monotonic() - detected}
        try:
            return self._restore_after(error, k, detected, set(dead), while_idle, parts, check_name=not standby)
        finally:
            # removed once the rollback is done: deleting a big dead layer beside the restore
            # slowed a heavy one by ~0.1 s (benchmarks/checkpoint_bench.py, prestaged_lost)
            remove_in_background(self.client, dead)

    def _restore_after(self, error: InfraError, k: int, detected: float, fenced: set[str], while_idle: bool,
                       parts: dict[str, float], check_name: bool = True) -> tuple[str, float, bool, bool, dict]:
        t = time.monotonic()
        if check_name and self._name_blocked(fenced):
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
        container: ``DockerSandbox.confirm_alive`` asks with one more exec before the agent is
        shown that exit code (one that forks nothing: a sandbox at its pids limit is alive)."""
        self.sandbox.confirm_alive(f"sandbox {self.name}: liveness probe")

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
