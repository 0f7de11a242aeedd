"""The Gymnasium env: ``RecoverableSandboxEnv`` (``recoverable``), its settings (``EnvConfig``),
the parts it holds (``episode``: the sandbox under its name; ``checkpointing``: captures;
``recovery``: rollbacks; ``turns``: one thread at a time and deaths while the agent
generates), when to checkpoint (``policy``, ``adaptive``), the committed trajectory,
rewards, text spaces, ``fork(n)`` of an env, and episodes that move node."""

from belayer_env.env.recoverable import SUBMIT_MARKER, EnvConfig, RecoverableSandboxEnv
from belayer_env.env.rewards import CommandReward

__all__ = ["SUBMIT_MARKER", "CommandReward", "EnvConfig", "RecoverableSandboxEnv"]
