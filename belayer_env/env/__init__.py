"""The Gymnasium env: ``RecoverableSandboxEnv`` (``recoverable``), its settings (``EnvConfig``),
its side of checkpointing (``checkpointing``), when to checkpoint (``policy``), the committed
trajectory, rewards, text spaces, ``fork(n)`` of an env, and episodes that move node."""

from belayer_env.env.recoverable import SUBMIT_MARKER, EnvConfig, RecoverableSandboxEnv
from belayer_env.env.rewards import CommandReward

__all__ = ["SUBMIT_MARKER", "CommandReward", "EnvConfig", "RecoverableSandboxEnv"]
