"""Wrappers that give an agent loop Belayer's recovery by wrapping (core never imports them).

- ``FaultInjection``: real faults into a RecoverableSandboxEnv (Gymnasium wrapper).
- ``ChatHistory``: owns the chat message list and cuts it back on rollback.
- ``RecoverableDockerEnvironment``: drop-in for mini-swe-agent's DockerEnvironment.
- ``RecoverableSkyRLEnv``: SkyRL's env interface (skyrl-gym ``Env``) over the env (``skyrl``).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "FaultInjection": ".fault_injection",
    "FaultInjectionConfig": ".fault_injection",
    "ChatHistory": ".chat_history",
    "parse_bash_block": ".chat_history",
    "RecoverableDockerEnvironment": ".minisweagent",
    "RecoverableDockerEnvironmentConfig": ".minisweagent",
    "RolledBack": ".minisweagent",
    "RecoverableSkyRLEnv": ".skyrl",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
