"""What a backend adds to the arena: memory served to its workers in the backend's own protocol.

The arena owns the memory of one device and outlives every worker. The reference worker
attaches to the arena's own regions (``server.py``); a backend whose workers speak another
protocol (SGLang's weight cache, its KV pool) hands the arena an ``ArenaExport`` that the
arena starts, describes, checksums, keeps at the current weight version and closes. The
arena never imports a backend: the backend's entry point builds the arena with its exports
(``belayer_engine.backends.sglang.arena``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ExportContext:
    """What an export is built from: the model's shape, its HF-named weights (CPU or device
    tensors, freed by the arena once every export is built) and the arena's device."""

    model: Any  # belayer_engine.model.config.ModelConfig
    weights: Mapping[str, Any]  # HF name -> torch.Tensor
    device: Any  # torch.device


class ArenaExport(Protocol):
    """One thing the arena serves beside its own regions."""

    name: str  # key in describe/health/checksums ("weight_cache", "kv_pool")
    holds_weights: bool  # a copy of the weights that weight updates must reach

    def start(self) -> None: ...

    def describe(self) -> dict: ...

    def checksum(self) -> str | None: ...

    def check_weights(self, tensors: Mapping[str, Any]) -> None:
        """Raise ``UsageError`` for an unknown name or a wrong shape, before anything changed."""

    def update_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        """Write ``tensors`` as ``version`` (the arena holds its update lock)."""

    def on_version(self, version: int) -> None:
        """The arena serves ``version`` from now on (called after every weight update)."""

    def ops(self) -> Mapping[str, Callable[[dict, int], dict]]:
        """Control-socket ops this export answers: ``op -> handler(message, arena_version)``."""

    def close(self) -> None: ...


ExportFactory = Callable[[ExportContext], ArenaExport]
