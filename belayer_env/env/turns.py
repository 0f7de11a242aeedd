"""Turns between the env and its agent: one thread at a time in the env, and a sandbox that
dies while the agent holds the turn (generates its next action) restored in the background,
so the next call finds it done (``EnvConfig(recover_while_idle=True)``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import docker

from belayer_core.errors import SandboxLost, UsageError
from belayer_env.common.background import Background
from belayer_env.env.episode import EpisodeSandbox
from belayer_env.env.trajectory import InfraEvent
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.deathwatch import DeathWatch


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
    """Deaths while the agent generates (``EnvConfig(recover_while_idle=True)``; the env holds one).

    The env gives the turn to the agent (``give_turn``: the sandbox is watched from then on)
    and takes it back at the agent's next call (``take_turn``: a restore begun meanwhile is
    waited for). A death in between is restored at once on a thread of its own, through
    ``recover`` (the env's rollback); its result waits in ``outcome`` for the next call.
    Disabled (``enabled=False``), every method is a no-op and ``outcome`` stays None.
    """

    def __init__(self, client: docker.DockerClient, episode: EpisodeSandbox, *, enabled: bool,
                 boundary: Callable[[], int], recover: Callable[[SandboxLost, int], tuple[tuple, InfraEvent]]):
        self.episode = episode
        self._boundary = boundary  # the agent's boundary k (committed steps)
        self._recover = recover  # the env's rollback at k: its step result and rollback event
        self._lock = threading.Lock()
        self._agent_turn = False  # between the env's return and the agent's next call
        self._recovery: Background | None = None
        self.outcome: IdleOutcome | None = None
        """What a restore begun while the agent generated left for its next call."""
        self._watch = DeathWatch(client, self._died) if enabled else None

    def give_turn(self, sandbox: DockerSandbox | None) -> None:
        """The env returns to the agent with ``sandbox`` at its boundary (None: the episode is over)."""
        if self._watch is None or sandbox is None:
            return
        with self._lock:
            self._agent_turn = True
            self._watch.arm(sandbox.container_id)

    def take_turn(self) -> None:
        """The agent calls again: stop watching; a restore begun meanwhile is waited for (its
        wait is recorded on its rollback event: the part of it the agent's time did not hide)."""
        if self._watch is None:
            return
        with self._lock:
            self._agent_turn = False
            self._watch.disarm()
            recovery, self._recovery = self._recovery, None
        if recovery is not None:
            t0 = time.monotonic()
            recovery.join()  # bounded: the restore's own attempts and waits are
            if self.outcome is not None and self.outcome.event is not None:
                self.outcome.event.waited_s = time.monotonic() - t0

    def take_outcome(self) -> IdleOutcome | None:
        outcome, self.outcome = self.outcome, None
        return outcome

    def _died(self, generation: int) -> None:
        """On the watch's thread: the init died while the agent generates; restore now."""
        with self._lock:
            if (not self._agent_turn or self._recovery is not None or self._watch is None
                    or generation != self._watch.generation):
                return
            self._recovery = Background(self._restore, name=f"belayer-idle-restore-{self.episode.name}")

    def _restore(self) -> None:
        k = self._boundary()
        if self.episode.own_exit() is not None:
            return  # its init exited by itself (a background job of an action): the next step judges that
        error = SandboxLost(f"sandbox {self.episode.name} died while the agent was generating its next action")
        event = None
        try:
            result: tuple | BaseException
            result, event = self._recover(error, k)
        except Exception as e:  # noqa: BLE001 - raised by the agent's next step, as the step's own recovery would
            result = e
        self.outcome = IdleOutcome(at_step=k, result=result, event=event)


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
