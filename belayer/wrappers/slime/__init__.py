"""slime's published extension points over Belayer (slime is not on the package index;
nothing here imports it at import time).

- ``generate``: for ``--custom-generate-function-path belayer.wrappers.slime.generate``
  (``async def generate(args, sample, sampling_params)``): one multi-turn episode in a
  ``RecoverableSandboxEnv``, token in, token out through SGLang's native ``/generate``
  (``rollout``); ``keep_group`` for ``--dynamic-sampling-filter-path`` drops the prompt group
  of a sample the infrastructure policy dropped.
- ``BelayerSandbox``: slime's ``Sandbox`` protocol (``slime/agent/sandbox.py``: ``exec``,
  ``write_file``, ``read_file``, async context) over a ``DockerSandbox`` or an env
  (``sandbox``).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "generate": ".rollout",
    "run_episode": ".rollout",
    "EpisodeConfig": ".rollout",
    "keep_group": ".rollout",
    "BelayerSandbox": ".sandbox",
    "SandboxRolledBack": ".sandbox",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
