"""Wrappers that give an agent loop Belayer's recovery by wrapping (core never imports them).

- ``FaultInjection``: real faults into a RecoverableSandboxEnv (Gymnasium wrapper).
- ``ChatHistory``: owns the chat message list and cuts it back on rollback.
- ``RecoverableDockerEnvironment``: drop-in for mini-swe-agent's DockerEnvironment.
- ``RecoverableSkyRLEnv``: SkyRL's env interface (skyrl-gym ``Env``) over the env (``skyrl``).
- ``InfraPolicy``, ``PolicyEnv``, ``SampleDropped``: the one policy for infrastructure failures
  every adapter follows (recover, else retry in a fresh sandbox, else drop with the group).
- trainer adapters in their own modules: ``slime``, ``verl``, ``areal`` (``SandboxWorkflow``),
  ``skyrl``, ``minisweagent``; TRL in ``belayer.examples.trl_grpo``.
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
    "InfraDropped": ".minisweagent",
    "RecoverableSkyRLEnv": ".skyrl",
    "InfraPolicy": ".infra_policy",
    "PolicyEnv": ".infra_policy",
    "SampleDropped": ".infra_policy",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
