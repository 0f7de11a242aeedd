"""belayer_env on Ray: env actors, an episode pool and a vector env that survive node loss.

Needs the ``ray`` extra (``pip install 'belayer[ray]'``); the rest of belayer_env never
imports Ray. Each node with a Docker engine joins the cluster with its sandbox limit as a
custom resource (``ray start --resources '{"belayer_sandbox": 16}'``); checkpoints are
replicated to ``RayEnvConfig.replica_url`` so that a lost node's episodes continue
elsewhere. See docs/cluster.md.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    from belayer_core.errors import UsageError

    raise UsageError("belayer_env.ray needs Ray: pip install 'belayer[ray]'") from e

from belayer_env.ray.config import SANDBOX_RESOURCE, RayEnvConfig
from belayer_env.ray.pool import EpisodePool, EpisodeResult
from belayer_env.ray.remote_env import RemoteSandboxEnv
from belayer_env.ray.vector import RayVectorEnv

__all__ = ["SANDBOX_RESOURCE", "EpisodePool", "EpisodeResult", "RayEnvConfig", "RayVectorEnv",
           "RemoteSandboxEnv"]
