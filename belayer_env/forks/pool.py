"""``ForkPool``: fork containers created ahead, so that ``fork(ck, n)`` only starts them.

Where the time of ``fork(ck, 8)`` went on the 2-core VM (docs/fork.md):
Docker's creates with their disk caps (mkfs + loop mount), ~0.4 s of CPU for eight, then
the eight starts from the checkpoint. A pool creates those containers in the background
(one at a time, while the agent's LLM generates) from the sandbox's exact image, settings
and network mode; ``fork(ck, n, pool=pool)`` takes one per fork whose checkpoint was taken
of a container made the same way (anything else is created then, as without a pool).

A pooled container is a sandbox like any other from its creation: named
``<fork name>-restoring-<id>``, labelled with its fork name and this process as owner (so
``belayer gc`` reaps it if this process dies), fenced and removed by ``close``. Its
shared-lower label (``store/shared_layer.py``) names an alias, made only when a fork
takes it: a symlink beside the checkpoint's shared copy that ``sweep`` counts as a use
of the copy while a container carries the alias, and removes after. A pooled container
serves only a shared fork (a fork with a copy of its own needs no shared-lower label).

The pool mechanism (``ContainerPool``) and ``RestoreSpare`` live in ``restore/spare.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from belayer_core.errors import UsageError
from belayer_env.forks.ahead import ForkAhead
from belayer_env.restore.spare import MAX_POOL, ContainerPool, RestoreSpare, Slot
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.create import create_container
from belayer_env.sandbox.ownership import SANDBOX_NAME
from belayer_env.store import shared_layer
from belayer_env.store.manifest import Checkpoint
from belayer_env.store.store import owner_tag

__all__ = ["MAX_POOL", "ForkPool", "RestoreSpare", "Slot"]


class ForkPool(ContainerPool):
    """Up to ``size`` fork containers for checkpoints of containers like ``sandbox``'s."""

    def __init__(self, sandbox: DockerSandbox, size: int, *, new_name: Callable[[], str] | None = None):
        super().__init__(sandbox, size, new_name=new_name)
        self.ahead: ForkAhead | None = None
        """The newest checkpoint's shared layer and images, verified ahead (``prepare``)."""

    def prepare(self, checkpoint: Checkpoint | None) -> None:
        """Verify ``checkpoint``'s shared layer and runtime images for its forks now, on a
        thread, and hold them (``fork_ahead``) until the next ``prepare`` (None: none) or
        ``close``; a fork of it into this pool then only starts containers."""
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            raise UsageError(f"prepare() takes a Checkpoint (or None), got {type(checkpoint).__name__}")
        with self._lock:
            old, self.ahead = self.ahead, None
            if checkpoint is not None and not self._closed and checkpoint.has_runtime:
                self.ahead = ForkAhead(checkpoint, self.client)
        if old is not None:
            old.close()

    def close(self) -> None:
        """Stop filling, drop what was verified ahead, remove every container still waiting."""
        super().close()
        self.prepare(None)

    def _create(self) -> Slot:
        target = self.new_name()
        alias = f"{shared_layer.ALIAS_PREFIX}{uuid.uuid4().hex[:12]}~{owner_tag()}"
        container = create_container(self.client, self.config, f"{target}-restoring-{uuid.uuid4().hex[:8]}",
                                     labels={SANDBOX_NAME: target, shared_layer.LABEL: alias},
                                     network_disabled=self.network_disabled)
        return Slot(container.id, container.attrs, target, alias)
