"""A restore's clean-up, off its critical path: spent copies deleted on threads that
``cleanup_deferred`` holds back (side-by-side forks) and ``wait_cleaned`` awaits."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from belayer_env.common.background import ThreadSet
from belayer_env.restore import ctrd_copies
from belayer_env.restore.staged import Staged
from belayer_env.sandbox import writeback

_cleaning = ThreadSet("belayer-restore-clean")


def discard_now(paths: list[Path], parts: list[Staged], nonces: list[str]) -> None:
    for part in parts:
        part.discard()
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    for nonce in nonces:
        ctrd_copies.remove(nonce)


def discard_later(paths: list[Path], parts: list[Staged], nonces: list[str]) -> None:
    _cleaning.start(discard_now, paths, parts, nonces)


@contextlib.contextmanager
def cleanup_deferred() -> Iterator[None]:
    """Restores that end meanwhile delete their spent copies and write back only when it
    ends (``fork``: eight restores side by side, the first ones' clean-up and ``syncfs``
    would take the CPU and disk from the others still restoring)."""
    with _cleaning.held(), writeback.held():
        yield


def clean_later(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` on a clean-up thread, errors ignored: held like a restore's own clean-up
    (``cleanup_deferred``), awaited by ``wait_cleaned``."""
    def quietly() -> None:
        with contextlib.suppress(Exception):
            fn(*args)

    _cleaning.start(quietly)


def wait_cleaned(timeout_s: float = 120.0) -> bool:
    """Wait for this process's restores to finish deleting their spent copies (``env.close``,
    tests); True when none is left. What a dying process leaves is removed by the next
    restore or prestage (``prestaging.clean_dead_staging``) and ``belayer gc``."""
    return _cleaning.wait(timeout_s)
