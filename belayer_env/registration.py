"""Gymnasium registration: ``gymnasium.make("belayer/Sandbox-v0", checkpoint_policy="adaptive")``.

Runs when ``belayer_env`` is imported (Gymnasium >= 1.0 no longer loads plugin entry
points), so either ``import belayer_env`` first or name the module in the id:
``gymnasium.make("belayer_env:belayer/Sandbox-v0")``. Registering twice is a no-op.
"""

from __future__ import annotations

ENV_ID = "belayer/Sandbox-v0"


def register_envs() -> None:
    from gymnasium.envs.registration import register, registry

    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point="belayer_env.env.recoverable:RecoverableSandboxEnv",
                 kwargs={"checkpoint_policy": "adaptive"})
