"""``Background``: a function on a thread whose result or error the caller collects later
(a restore's fence beside its create, a prestage's image check beside its unpack)."""

from __future__ import annotations

import threading
from collections.abc import Callable
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
