"""Turns between the env and its agent: one thread at a time in the env, and a sandbox that
dies while the agent holds the turn (generates its next action) restored in the background,
so the next call finds it done (``EnvConfig(recover_while_idle=True)``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from belayer_core.errors import SandboxLost, UsageError
from belayer_env.background import Background
from belayer_env.env.trajectory import InfraEvent


class OneThread:
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


class IdleRecovery:
    """Deaths while the agent generates, for ``RecoverableSandboxEnv`` (``self`` is the env)."""

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
        self._idle_outcome = IdleOutcome(at_step=k, result=result, event=event)


class IdleOutcome:
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
