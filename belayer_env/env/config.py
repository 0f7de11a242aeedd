"""``EnvConfig``: how the env runs, recovers and formats (the sandbox has its own config), and
the keyword overrides ``gym.make`` passes, validated like a fresh config."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from belayer_core.errors import ConfigError
from belayer_env.sandbox.config import SandboxConfig, StrictModel

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
OBSERVATION_TEMPLATE = "<returncode>{returncode}</returncode>\n<output>\n{output}</output>"


class EnvConfig(StrictModel):
    """How the env runs, recovers and formats (the sandbox has its own config)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    observation_template: str = OBSERVATION_TEMPLATE
    max_steps: int | None = Field(default=None, ge=1)
    """Truncate the episode after this many committed steps (None: never)."""
    checkpoint_dir: str | None = None
    """Checkpoint store directory (None: a private temporary one, removed at close)."""
    keep_checkpoints: int = Field(default=3, ge=1)
    runtime: bool = True
    """Capture process state with CRIU (False: file-system-only checkpoints)."""
    allow_degraded: bool = False
    """Accept a file-system-only restore when the runtime cannot be restored (reported)."""
    recovery_attempts: int = Field(default=4, ge=1)
    """Restore attempts per failure before the episode is given up (the error is raised)."""
    pending_wait_s: float = Field(default=30.0, ge=0)
    """On failure, how long to wait for a capture still being written (it predates the fault)."""
    standby: bool = False
    """Keep the newest checkpoint pre-restored in a frozen standby when the policy agrees
    (memory, cost): a rollback onto it is fence + thaw + verify (``restore/standby.py``)."""
    fork_pool: int = Field(default=0, ge=0, le=64)
    """Keep this many fork containers created ahead, refilled in the background after
    ``reset`` and each ``fork`` (``belayer_env.forks.pool``): ``fork(n)`` then only starts
    them. Each costs a created container (and its disk cap's loop mount). 0: off."""
    restore_spare: bool = False
    """Keep one container created ahead for the next restore, refilled in the background
    after ``reset`` and each rollback (``restore.spare.RestoreSpare``): a rollback without a
    standby skips Docker's create. Costs a created container (no memory)."""
    recover_while_idle: bool = False
    """Watch the sandbox while the agent holds the turn (generates its next action) and, when
    it dies then, restore the newest ready checkpoint j at once, in the background. The next
    call finds it restored: ``step`` runs its action on it when j is the agent's boundary
    (that action never ran, so nothing is replayed), else returns the rollback to j without
    waiting for a restore. Needs the container's init pid visible here (``deathwatch``)."""


def with_overrides(config: EnvConfig | None, overrides: dict[str, Any]) -> EnvConfig:
    """``config`` (default: ``EnvConfig()``) with keyword overrides (``gym.make`` kwargs): names of
    ``EnvConfig`` fields set the env, every other name the sandbox; all validated (``ConfigError``)."""
    if config is not None and not isinstance(config, EnvConfig):
        raise ConfigError(f"config must be an EnvConfig, got {type(config).__name__}")
    config = config or EnvConfig()
    if not overrides:
        return config
    env_fields = {k: v for k, v in overrides.items() if k in EnvConfig.model_fields}
    base = env_fields.pop("sandbox", config.sandbox)
    if isinstance(base, dict):
        base = SandboxConfig(**base)
    sandbox = SandboxConfig.merged(base, {k: v for k, v in overrides.items() if k not in EnvConfig.model_fields})
    return EnvConfig(**{**dict(config), **env_fields, "sandbox": sandbox})
