"""Creation settings of a sandbox container (one pydantic config for the Docker backend).

The same config recreates an equivalent container on restore, so everything that shapes
the container (image, limits, tty, env, working dir) lives here and nowhere else.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_IMAGE = os.environ.get("BELAYER_BASE_IMAGE", "belayer-base:latest")
MANAGED_LABEL = "belayer.managed"


class SandboxConfig(BaseModel):
    """How to create a sandbox. Secure by default: no network, bounded memory/pids/CPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str = DEFAULT_IMAGE
    cwd: str = "/"
    """Working directory for commands when ``execute`` gets no ``cwd``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set in the container and for every command."""
    timeout: float = 30.0
    """Default command timeout in seconds (an agent outcome, not an error)."""
    network: bool = False
    """Attach a network. Off by default: sandboxes must not reach the outside."""
    memory: str = "1g"
    """Memory limit (docker syntax: 512m, 2g). Swap is not allowed on top of it."""
    pids_limit: int = 512
    cpus: float = 1.0
    max_output_bytes: int = 100_000
    """Output beyond this is cut in the middle with a truncation marker."""
    labels: dict[str, str] = Field(default_factory=dict)
    name_prefix: str = "belayer"
    docker_host: str | None = None
    """Docker daemon URL (e.g. unix:///var/run/docker.sock); None = the environment's."""

    @field_validator("cwd")
    @classmethod
    def _absolute_cwd(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"cwd must be an absolute path inside the container, got {v!r}")
        return v

    @field_validator("timeout", "cpus")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @field_validator("pids_limit", "max_output_bytes")
    @classmethod
    def _positive_int(cls, v: int) -> int:
        if v < 16:
            raise ValueError(f"must be >= 16, got {v}")
        return v
