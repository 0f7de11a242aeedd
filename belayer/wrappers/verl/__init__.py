"""verl's agent loop over Belayer: LLM calls to the engine, tools in a recoverable sandbox.

- ``EngineClient`` (``client``): verl's ``LLMServerClient`` whose ``generate`` posts
  SGLang's native ``/generate`` to Belayer's router (the call verl's SGLang replica makes
  in-process, over HTTP), returning verl's ``TokenOutput``.
- ``BelayerSandboxAgentLoop`` (``agent_loop``): an ``AgentLoopBase`` registered with verl's
  own ``@register("belayer_sandbox")``; one multi-turn episode of bash actions in a
  ``RecoverableSandboxEnv`` per sample, under ``belayer.wrappers.infra_policy``.
- ``AGENT_LOOPS_YAML``: the ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` file
  that names it (so verl's workers import it).

verl (0.9.1) lives in its own venv (``scripts/setup_verl.sh``); nothing here imports it
until one of these names is used.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

AGENT_NAME = "belayer_sandbox"
AGENT_LOOPS_YAML = str(Path(__file__).with_name("agent_loops.yaml"))

_LAZY = {
    "EngineClient": ".client",
    "BelayerAgentLoopManager": ".client",
    "BelayerSandboxAgentLoop": ".agent_loop",
    "SandboxLoopConfig": ".config",
}

__all__ = ["AGENT_NAME", "AGENT_LOOPS_YAML", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
