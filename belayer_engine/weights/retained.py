"""Weight updates the engine keeps, so that a slot restarted from scratch never serves stale weights.

A trainer pushes updates through ``RecoverableEngine.update_weights``; every slot's arena
gets the same engine-wide version. The newest value of every updated tensor is kept here
(a host copy: the price of recovering without the trainer), and a slot whose arena is
cold-restarted gets all of them, merged into one update with the current version, before
a worker is routed to it. Torch-free like the rest of the supervisor: the tensors are the
caller's objects (copied with their own methods) and travel through ``ArenaClient``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class RetainedWeights:
    """The newest value of each updated weight (by HF name) and the engine-wide version."""

    def __init__(self) -> None:
        self.version = 0
        self._tensors: dict[str, Any] = {}

    def merge(self, tensors: Mapping[str, Any], version: int) -> None:
        for name, t in tensors.items():
            self._tensors[name] = t.detach().to("cpu", copy=True).contiguous()
        self.version = version

    def snapshot(self) -> tuple[dict[str, Any], int]:
        """Everything updated so far (empty before the first update) and its version."""
        return dict(self._tensors), self.version

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())
