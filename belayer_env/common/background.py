"""``Background``: a function on a thread whose result or error the caller collects later
(a restore's fence beside its create, a prestage's image check beside its unpack).
``ThreadSet``: fire-and-forget work whose end can still be awaited."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class Background:
    """``fn(*args, **kwargs)`` on a daemon thread; ``result()`` joins it and returns its value or raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str = "belayer-bg", **kwargs: Any):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True, name=name)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        try:
            self._value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._error = e

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class ThreadSet:
    """Work moved off a critical path onto daemon threads (a restore's spent copies, a
    fenced container's removal) that ``wait`` can still see through: ``env.close``
    before it returns, a benchmark before its next timed call."""

    def __init__(self, name: str):
        self.name = name
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._holds = 0
        self._held: list[tuple[Callable[..., Any], tuple]] = []

    def start(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._holds:
                self._held.append((fn, args))
                return
        self._start(fn, *args)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Work started meanwhile waits until the last hold ends (``fork``: the first forks'
        clean-up would otherwise take CPU from the forks still restoring)."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                due, self._held = (self._held, []) if not self._holds else ([], self._held)
            for fn, args in due:
                self._start(fn, *args)

    def _start(self, fn: Callable[..., Any], *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, daemon=True, name=self.name)
        # Listed and started under one lock: ``wait`` must never see (and join) a thread
        # that has not started yet (``RuntimeError: cannot join thread before it is started``).
        with self._lock:
            self._threads.add(thread)
            try:
                thread.start()
            except BaseException:
                self._threads.discard(thread)
                raise

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every thread started so far; True when none is left.
        Work held back (``held``) has not started: it is waited for once its hold ended."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                threads = list(self._threads)
            if not threads:
                return True
            threads[0].join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                with self._lock:
                    return not self._threads
