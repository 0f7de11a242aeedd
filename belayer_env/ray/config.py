"""``RayEnvConfig``: how envs are placed on a Ray cluster and where their checkpoints outlive a node."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from belayer_env.env.recoverable import EnvConfig

SANDBOX_RESOURCE = "belayer_sandbox"


class RayEnvConfig(BaseModel):
    """One config for every env actor of a pool or vector env.

    Each node advertises how many sandboxes it may run as a Ray custom resource
    (``ray start --resources '{"belayer_sandbox": 16}'``); each env actor takes one unit, so
    Ray never places more sandboxes on a node than it declared, and an actor waits for a
    free unit when the cluster is full (back-pressure).
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    replica_url: str
    """fsspec URL every node can reach (file:///shared/dir, s3://bucket/prefix, gs://...)."""
    replica_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec storage options for ``replica_url`` (credentials, endpoint)."""
    replica_key_file: str | None = None
    """The cluster's replica key, the same file on every node (``store/replica_auth.py``: 32+
    random bytes, mode 0600); None: ``$BELAYER_REPLICA_KEY_FILE``. Replicas are authenticated."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    checkpoint_policy: str = "adaptive"
    """``adaptive``, ``always`` or ``never`` (``never``: a lost node restarts the task)."""
    resource: str = SANDBOX_RESOURCE
    """The custom resource one sandbox takes on its node."""
    actor_options: dict[str, Any] = Field(default_factory=lambda: {"scheduling_strategy": "SPREAD"})
    """Extra ``ray.remote(...).options()`` for env actors (placement, runtime_env)."""
    start_timeout_s: float = 600.0
    """How long an actor may wait for a node with a free sandbox slot, then start and answer."""
    call_timeout_s: float = 3600.0
    """Bound on one env call (a step: the command's timeout plus any local recovery)."""
    max_failovers: int = 3
    """Node losses in a row one call survives before the episode is given up (``NodeLost``)."""

    @field_validator("checkpoint_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in ("adaptive", "always", "never"):
            raise ValueError(f"checkpoint_policy must be adaptive, always or never, got {v!r}")
        return v

    @field_validator("replica_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if "://" not in v:
            raise ValueError(f"replica_url must be a URL every node reaches (file:///dir, s3://...), got {v!r}")
        return v

    @field_validator("start_timeout_s", "call_timeout_s")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError(f"must be > 0, got {v}")
        return v
