"""The named phases of capture, pre-staging and restore, and the hooks called at them.

A phase hook is called with the ``Phase`` just reached, on the thread doing the work.
It may raise: the operation then fails there as if the process doing it had crashed
(that is how fault injection tests every phase). ``Phase`` is a ``StrEnum``, so it also
compares equal to its plain name (``Phase.FROZEN == "frozen"``).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Literal

Operation = Literal["checkpoint", "prestage", "restore"]


class Phase(StrEnum):
    # full_checkpoint, in order
    FROZEN = "frozen"
    RUNTIME_DUMPED = "runtime_dumped"
    LAYER_CAPTURED = "layer_captured"
    THAWED = "thawed"
    WRITTEN = "written"
    PUBLISHED = "published"
    # prestage (after publish, off the critical path)
    LAYER_UNPACKED = "layer_unpacked"
    IMAGES_VERIFIED = "images_verified"
    STAGED = "staged"
    """prestage: the copy is complete; full_restore: a pre-staged copy was claimed."""
    # full_restore (CREATED and VERIFIED also bracket a fresh boundary-0 sandbox)
    CREATED = "created"
    LAYER_INSTALLED = "layer_installed"
    RUNTIME_VERIFIED = "runtime_verified"
    STARTED = "started"
    VERIFIED = "verified"
    # standby (restore/standby.py): prepared and frozen; thawed during a rollback
    STANDBY_FROZEN = "standby_frozen"
    STANDBY_THAWED = "standby_thawed"

    @property
    def operation(self) -> Operation:
        if self in CAPTURE_PHASES:
            return "checkpoint"
        if self in (Phase.LAYER_UNPACKED, Phase.IMAGES_VERIFIED):
            return "prestage"
        return "restore"


CAPTURE_PHASES = (Phase.FROZEN, Phase.RUNTIME_DUMPED, Phase.LAYER_CAPTURED, Phase.THAWED, Phase.WRITTEN,
                  Phase.PUBLISHED)
RESTORE_PHASES = (Phase.CREATED, Phase.LAYER_INSTALLED, Phase.STARTED, Phase.VERIFIED)
"""The restore phases every restore passes (boundary 0 included): where faults are injected."""

PhaseHook = Callable[[Phase], None]


class PhaseHooks:
    """An ordered set of hooks, itself callable as one hook (what the mechanism receives)."""

    def __init__(self) -> None:
        self._hooks: list[PhaseHook] = []

    def add(self, hook: PhaseHook) -> Callable[[], None]:
        """Register ``hook``; returns a function that removes it again."""
        self._hooks.append(hook)
        return lambda: self.remove(hook)

    def remove(self, hook: PhaseHook) -> None:
        if hook in self._hooks:
            self._hooks.remove(hook)

    def __call__(self, phase: Phase) -> None:
        for hook in list(self._hooks):
            hook(phase)

    def __bool__(self) -> bool:
        return bool(self._hooks)


def no_hook(_phase: Phase) -> None:
    """The hook of an operation nobody observes."""
