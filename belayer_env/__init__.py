"""belayer_env: recoverable Docker sandboxes for agentic RL.

``DockerSandbox`` runs commands in a real container; checkpoint/restore and the Gymnasium
``RecoverableSandboxEnv`` build on it. Names resolve lazily so importing the package stays
cheap (``import belayer_env`` does not load the checkpoint mechanism or the env).
"""

from __future__ import annotations

import importlib
from typing import Any

from belayer_env.registration import register_envs
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox

_LAZY = {
    "Checkpoint": "belayer_env.store.manifest",
    "CheckpointStore": "belayer_env.store.store",
    "full_checkpoint": "belayer_env.capture.checkpoint",
    "full_restore": "belayer_env.restore.restore",
    "start_checkpoint": "belayer_env.capture.pending",
    "prestage": "belayer_env.restore.prestaging",
    "fence": "belayer_env.sandbox.fence",
    "fork": "belayer_env.forks.fork",
    "ForkPool": "belayer_env.forks.pool",
    "RestoreSpare": "belayer_env.restore.spare",
    "Phase": "belayer_env.common.phases",
    "RecoverableSandboxEnv": "belayer_env.env.recoverable",
    "Sandbox": "belayer_env.sandbox.protocol",
}

__all__ = ["DockerSandbox", "SandboxConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'belayer_env' has no attribute {name!r}")


# Gymnasium >= 1.0 no longer loads `gymnasium.envs` entry points, so register on import:
# `import belayer_env; gymnasium.make("belayer/Sandbox-v0")` (issue 4).
register_envs()
