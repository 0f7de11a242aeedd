"""belayer_engine: arena server, reference worker, router. Names load lazily (no torch on import)."""

from __future__ import annotations

import importlib

_LAZY = {
    "ArenaClient": "belayer_engine.arena.client",
    "ArenaConfig": "belayer_engine.arena.config",
    "ArenaServer": "belayer_engine.arena.server",
    "ModelConfig": "belayer_engine.model.config",
    "WorkerConfig": "belayer_engine.backends.reference.config",
    "WorkerState": "belayer_engine.backends.reference.state",
    "SamplingParams": "belayer_engine.backends.reference.sampling",
    "apply_chat_template": "belayer_engine.model.chat_template",
    "load_tokenizer": "belayer_engine.model.tokenizer",
    "ByteTokenizer": "belayer_engine.model.tokenizer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'belayer_engine' has no attribute {name!r}")


__all__ = sorted(_LAZY)

# Issue 6 (router + supervisor): the engine front door, resolved lazily like the rest.
_LAZY["RecoverableEngine"] = "belayer_engine.engine"
__all__ = sorted(_LAZY)
