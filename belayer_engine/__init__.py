"""belayer_engine: arena server, reference worker, router. Names load lazily (no torch on import)."""

from __future__ import annotations

import importlib

_LAZY = {
    "ArenaClient": "belayer_engine.arena_client",
    "ArenaConfig": "belayer_engine.arena",
    "ArenaServer": "belayer_engine.arena",
    "ModelConfig": "belayer_engine.model_config",
    "WorkerConfig": "belayer_engine.worker",
    "WorkerRuntime": "belayer_engine.runtime",
    "SamplingParams": "belayer_engine.sampling",
    "apply_chat_template": "belayer_engine.chat_template",
    "load_tokenizer": "belayer_engine.tokenizer",
    "ByteTokenizer": "belayer_engine.tokenizer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'belayer_engine' has no attribute {name!r}")


__all__ = sorted(_LAZY)

# Issue 6 (router + supervisor): the engine front door, resolved lazily like the rest.
_LAZY["RecoverableEngine"] = "belayer_engine.launch"
__all__ = sorted(_LAZY)
