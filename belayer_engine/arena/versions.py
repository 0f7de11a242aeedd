"""Weight-version updates of the arena: double-buffered, confirmed by every worker.

A new version is written into the slot nobody serves, published (version + 1), pushed to
every attached worker, and ``update_weights`` returns only when each live worker has
confirmed it switched. The slot being overwritten is always one no worker uses (the update
first waits until all of them confirmed the current version), so no copy happens in
workers and no stale version is served after ``update_weights`` returns. An arena without
reference slots updates its exports' weights alone (they are the only copy).

A mixin of ``ArenaServer`` (the state it uses: ``cfg``, ``device``, ``layout``, ``regions``,
``slots``, ``exports``, ``links``, ``cond``, ``update_lock``, ``version``, ``slot``).
"""

from __future__ import annotations

import torch

from belayer_core.errors import UsageError, WorkerLost


class WeightVersions:
    """``update_weights`` and what it tells the exports (mixed into ``ArenaServer``)."""

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Write a new version into the free slot, publish it, wait for every worker.

        ``version``: the number to publish (default: current + 1). An engine spread over
        several arenas (``belayer_engine.ray``) gives a fresh arena its engine-wide version
        in one update, so every slot reports the same number for the same weights.
        """
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise UsageError(f"version must be an int, got {version!r}")
        if not self.slots:
            return self._update_weight_cache_only(tensors, version)
        for name, t in tensors.items():
            if name not in self.layout:
                raise UsageError(f"unknown weight {name!r}")
            if list(t.shape) != self.layout[name][1]:
                raise UsageError(f"{name}: shape {list(t.shape)} != {self.layout[name][1]}")
        with self.update_lock:
            with self.cond:
                if not self.cond.wait_for(lambda: self.links.all_on(self.version),
                                          self.cfg.ack_timeout_s):
                    raise WorkerLost(f"workers still serve an older version: "
                                     f"{self.links.laggards(self.version)}")
                if version is not None and version <= self.version:
                    raise UsageError(f"version {version} is not newer than the current {self.version}")
                staging = 1 - self.slot
            names = ("w0", "w1")
            self.regions[names[staging]].copy_(self.regions[names[self.slot]])
            for name, t in tensors.items():
                self.slots[staging][name].copy_(t)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            with self.cond:
                self.version = self.version + 1 if version is None else version
                self.slot = staging
                version = self.version
                self.links.push_all({"event": "version", "version": version, "slot": staging})
                if not self.cond.wait_for(lambda: self.links.all_on(version), self.cfg.ack_timeout_s):
                    raise WorkerLost(f"version {version} published but not confirmed by "
                                     f"{self.links.laggards(version)}")
            self._update_exports(tensors, version)
        return version

    def _update_exports(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        for export in self.exports:  # in place, their servers paused meanwhile
            if export.holds_weights:
                export.update_weights(tensors, version)
        for export in self.exports:
            export.on_version(version)

    def _update_weight_cache_only(self, tensors: dict[str, torch.Tensor], version: int | None) -> int:
        """No reference slots: an export's weights are the only copy; written in place while
        every server mapping them is paused (e.g. ``WeightCacheExport.update_weights``)."""
        for export in self.exports:
            if export.holds_weights:
                export.check_weights(tensors)
        with self.update_lock:
            with self.cond:
                if version is not None and version <= self.version:
                    raise UsageError(f"version {version} is not newer than the current {self.version}")
                self.version = self.version + 1 if version is None else version
                version = self.version
            self._update_exports(tensors, version)
        return version
