"""Gymnasium registration: ``gymnasium.make("belayer/Sandbox-v0", checkpoint_policy="adaptive")``.

Called from the ``gymnasium.envs`` entry point (tools that load plugins) and when
``belayer_env`` is imported; registering twice is a no-op.
"""

from __future__ import annotations

ENV_ID = "belayer/Sandbox-v0"


def register_envs() -> None:
    from gymnasium.envs.registration import register, registry

    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point="belayer_env.env:RecoverableSandboxEnv",
                 kwargs={"checkpoint_policy": "adaptive"})
