"""``start_checkpoint``: the same checkpoint on a background thread.

The env takes checkpoints inside the LLM's generation bubble: it waits for ``.thawed``
(the sandbox runs again) and lets hashing, writing and publishing overlap the model's
thinking. ``cancel()`` abandons it: the sandbox is thawed if frozen and nothing is
published (a checkpoint that made it to the store before the cancel is removed again).
``abort()`` is cancel for a sandbox about to be fenced: it also kills a CRIU dump in
progress, which a dead container can otherwise hold forever (see ``runtime.dump``).
With ``prestage=True`` (the default) the same thread then pre-stages the published
checkpoint on Docker's disk (``prestaging``) so a restore skips the unpack; ``wait()`` and
``done()`` do not wait for that, ``.prestaged`` is set when it ends (staged or not).
"""

from __future__ import annotations

import contextlib
import threading

from belayer_core.errors import CheckpointFailed
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.common.phases import Phase, PhaseHook
from belayer_env.restore.prestaging import discard_copies
from belayer_env.restore.prestaging import prestage as prestage_checkpoint
from belayer_env.sandbox.protocol import Sandbox
from belayer_env.store.manifest import Checkpoint
from belayer_env.store.store import CheckpointStore


class _Cancelled(Exception):
    pass


class PendingCheckpoint:
    """Handle of a checkpoint running on a thread."""

    def __init__(self, sandbox: Sandbox, store: CheckpointStore, step: int | None, runtime: bool,
                 phase_hook: PhaseHook | None, prestage: bool = True):
        self.thawed = threading.Event()
        self.prestaged = threading.Event()
        """Set once the pre-staging after publish has ended (or was not to happen)."""
        self._finished = threading.Event()
        self._prestage = prestage
        self._cancel = threading.Event()
        self._abort = threading.Event()
        self._stop_prestage = threading.Event()
        self._delivered = False
        self._store = store
        self._user_hook = phase_hook
        self._result: Checkpoint | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(sandbox, step, runtime),
                                        daemon=True, name=f"belayer-checkpoint-{sandbox.name}")
        self._thread.start()

    def _hook(self, phase: Phase) -> None:
        # PUBLISHED is past the point of no return: failing there would leave the checkpoint
        # published (locally and, for a replicated store, at its URL) with nobody to remove
        # it; ``_run`` removes a checkpoint whose cancel landed during publish instead.
        if self._cancel.is_set() and phase is not Phase.PUBLISHED:
            raise _Cancelled(f"cancelled before {phase}")
        if self._user_hook is not None:
            self._user_hook(phase)

    def _run(self, sandbox: Sandbox, step: int | None, runtime: bool) -> None:
        try:
            ck = full_checkpoint(sandbox, self._store, step, runtime=runtime,
                                 phase_hook=self._hook, _thawed=self.thawed, _abort=self._abort)
            if self._cancel.is_set():
                self._store.remove(ck.id)
            else:
                self._result = ck
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            self._error = e
        finally:
            self.thawed.set()
        try:
            if self._result is not None and self._prestage and not self._prestage_stopped():
                # registered as in flight before wait() returns: a restore of it waits for
                # the staged copy rather than unpacking a second time
                prestage_checkpoint(self._result, sandbox.client, phase_hook=self._prestage_hook,
                                    _started=self._finished.set)
        except Exception:  # noqa: BLE001, S110 - best effort: a restore then unpacks itself
            pass
        finally:
            if self._result is not None and self._prestage_stopped():
                with contextlib.suppress(Exception):
                    discard_copies(sandbox.client, self._result.id)
                if self._cancel.is_set() and not self._delivered:  # cancelled after publish: unused
                    with contextlib.suppress(Exception):
                        self._store.remove(self._result.id)
            self._finished.set()
            self.prestaged.set()

    def _prestage_stopped(self) -> bool:
        return self._stop_prestage.is_set() or self._cancel.is_set()

    def _prestage_hook(self, phase: Phase) -> None:
        if self._prestage_stopped():
            raise _Cancelled(f"pre-staging stopped before {phase}")

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The published checkpoint once there is one (None before, or if it failed)."""
        return self._result

    def stop_prestage(self, timeout: float) -> bool:
        """Stop the pre-staging after publish and remove its copy (the checkpoint is going
        away); True once it has ended, False if it is still running after ``timeout``."""
        self._stop_prestage.set()
        return self.prestaged.wait(timeout)

    def wait(self, timeout: float | None = None) -> Checkpoint | None:
        """The published checkpoint; None if cancelled; re-raises ``CheckpointFailed``."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"checkpoint still running after {timeout} s")
        if self._cancel.is_set():
            return None
        if self._error is not None:
            if isinstance(self._error, CheckpointFailed):
                raise self._error
            raise CheckpointFailed(str(self._error)) from self._error
        self._delivered = self._result is not None
        return self._result

    def cancel(self) -> None:
        """Abandon: publish nothing. Returns at once; ``wait()`` then returns None."""
        self._cancel.set()

    def abort(self) -> None:
        """Cancel and kill a CRIU dump in progress (only for a sandbox about to be fenced:
        the dumped processes may be left half-dumped). Returns at once."""
        self._cancel.set()
        self._abort.set()

    def done(self) -> bool:
        return self._finished.is_set()


REASON_CHARS = 300


def reason_of(error: BaseException) -> str:
    """Why a capture failed, in one line: the ``reason`` of the error or of what caused it
    (CRIU's own error line, a refused dump's cause), else the message's first line."""
    seen: BaseException | None = error
    while seen is not None:
        reason = getattr(seen, "reason", None)
        if isinstance(reason, str) and reason.strip():
            return reason.strip().splitlines()[0][:REASON_CHARS]
        seen = seen.__cause__
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:REASON_CHARS]


def start_checkpoint(sandbox: Sandbox, store: CheckpointStore, step: int | None = None, *, runtime: bool = True,
                     phase_hook: PhaseHook | None = None, prestage: bool = True) -> PendingCheckpoint:
    """Start ``full_checkpoint`` on a background thread; see ``PendingCheckpoint``.

    ``prestage``: after publish, unpack + verify it on Docker's disk on the same thread
    (``prestaging.prestage``) so that ``full_restore`` of it installs with renames only.
    """
    return PendingCheckpoint(sandbox, store, step, runtime, phase_hook, prestage)
