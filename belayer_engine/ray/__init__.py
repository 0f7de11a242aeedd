"""belayer_engine on Ray: engine slots placed on Ray nodes behind one router (the ``ray`` extra).

Nothing else in belayer_engine imports Ray. See docs/cluster.md.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    from belayer_core.errors import UsageError

    raise UsageError("belayer_engine.ray needs Ray: pip install 'belayer[ray]'") from e

from belayer_engine.ray.engine import SLOT_RESOURCE, RayEngine, RayEngineConfig

__all__ = ["SLOT_RESOURCE", "RayEngine", "RayEngineConfig"]
