"""Docker's names of a sandbox, set off a rollback's critical path.

A promoted standby takes its sandbox's name through Docker renames, which cost tens of ms
under load: they run later, queued to this module's one worker thread (``settle_later``),
and until Docker names the promoted container so, this process counts it as the sandbox's
(``add_alias``). Every listing of a sandbox (``fence.sandbox_containers``: a fence, a
restore, ``env.close``) first waits for that sandbox's queued jobs (``settled``), so none
acts on names that are not set yet.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

_pending: dict[str, threading.Event] = {}
_lock = threading.Lock()
_aliases: dict[str, set[str]] = {}
_jobs: queue.SimpleQueue = queue.SimpleQueue()
_worker: threading.Thread | None = None


def add_alias(sandbox_name: str, container_id: str) -> None:
    """Count ``container_id`` as a container of ``sandbox_name`` in this process's listings
    before Docker names it so (a standby being promoted: its rename follows on a thread)."""
    with _lock:
        _aliases.setdefault(sandbox_name, set()).add(container_id)


def drop_alias(sandbox_name: str, container_id: str) -> None:
    with _lock:
        ids = _aliases.get(sandbox_name, set())
        ids.discard(container_id)
        if not ids:
            _aliases.pop(sandbox_name, None)


def aliases(sandbox_name: str) -> set[str]:
    with _lock:
        return set(_aliases.get(sandbox_name, ()))


def settle_later(sandbox_name: str, fn: Any, *args: Any) -> threading.Event:
    """Run ``fn(*args)``, Docker's bookkeeping of sandbox ``sandbox_name`` (renames), on this
    module's worker thread, off a rollback's critical path (queued, not started: a thread
    start would wait for the CPU on a busy host). Every later listing of that sandbox in
    this process waits for it first (``settled``). ``fn`` must not list that sandbox
    itself. Returns the job's end (set once it ran, whatever its outcome)."""
    done = threading.Event()
    with _lock:
        _pending[sandbox_name] = done
    _jobs.put((fn, args, done))
    start_worker()
    return done


def start_worker() -> None:
    """Start the worker once per process (a ``Standby`` does at its creation, not on a rollback)."""
    global _worker
    with _lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, daemon=True, name="belayer-fence-names")
            _worker.start()


def settled(sandbox_name: str) -> None:
    """Return once every job queued for ``sandbox_name`` so far has run."""
    with _lock:
        done = _pending.get(sandbox_name)
    if done is None:
        return
    done.wait()  # FIFO: every earlier job of that name has run too
    with _lock:
        if _pending.get(sandbox_name) is done:
            del _pending[sandbox_name]


def settle_all() -> None:
    """``settled`` for every sandbox with a job queued in this process."""
    with _lock:
        names = list(_pending)
    for name in names:
        settled(name)


def _work() -> None:
    while True:
        fn, args, done = _jobs.get()
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001, S110 - the job cleans up after itself
            pass
        finally:
            done.set()
