"""Writing a replica: the checkpoint's files copied (every byte checked on the way), then
committed by its marker, written under a temporary name and moved into place last.

On a local file system (``file://``, an NFS mount) every file and directory is fsynced
before the marker is moved; object stores make an object durable when it is closed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from belayer_env.store.manifest import MANIFEST, check_file, copy_hashed
from belayer_env.store.replica_auth import ReplicaKey
from belayer_env.store.replica_marker import EPISODE, Replica, marker_path, signed
from belayer_env.store.store import fsync_dir


class Writer:
    """Writes into one replica location (``fs`` at ``root``; ``local``: fsync as it goes)."""

    def __init__(self, fs: Any, root: str, key: ReplicaKey, *, local: bool):
        self.fs, self.root, self.key, self.local = fs, root, key, local

    def upload(self, directory: Path, data: dict[str, Any], manifest_sha: str,
               episode: dict[str, Any] | None) -> Replica:
        """Copy the checkpoint ``directory`` (its manifest ``data``, hashing to ``manifest_sha``)
        and ``episode``, then commit it; storage errors propagate (nothing is committed)."""
        ck_id, sandbox = data["id"], data["sandbox"]
        base = f"{self.root}/{sandbox}/{ck_id}"
        self.fs.makedirs(base, exist_ok=True)
        for rel, meta in sorted(data["files"].items()):
            self.fs.makedirs(parent(f"{base}/{rel}"), exist_ok=True)
            with open(directory / rel, "rb") as src, self.fs.open(f"{base}/{rel}", "wb") as dst:
                size, digest = copy_hashed(src, dst)
                self._durable(dst)
            check_file(rel, meta, size, digest)
        self._put(f"{base}/{MANIFEST}", (directory / MANIFEST).read_bytes())
        episode_sha = None
        if episode is not None:
            raw = json.dumps(episode, sort_keys=True).encode()
            episode_sha = hashlib.sha256(raw).hexdigest()
            self._put(f"{base}/{EPISODE}", raw)
        if self.local:
            for d in {parent(f"{base}/{rel}") for rel in data["files"]} | {base}:
                fsync_dir(Path(d))
        marker = Replica(ck_id, sandbox, int(data["step"]), time.time(), manifest_sha, episode_sha)
        self._commit(marker)
        return marker

    def _commit(self, marker: Replica) -> None:
        final = marker_path(self.root, marker.sandbox, marker.id)
        tmp = f"{self.root}/{marker.sandbox}/.tmp-{marker.id}-{uuid.uuid4().hex[:8]}"
        self._put(tmp, signed(marker, self.key))
        self.fs.mv(tmp, final)  # local: rename(2); object stores: one server-side copy
        if self.local:
            fsync_dir(Path(parent(final)))

    def _put(self, path: str, raw: bytes) -> None:
        with self.fs.open(path, "wb") as f:
            f.write(raw)
            self._durable(f)

    def _durable(self, f: Any) -> None:
        """fsync a file written through fsspec's local file system (object stores: on close)."""
        if self.local:
            f.flush()
            inner = getattr(f, "f", f)
            with contextlib.suppress(AttributeError, OSError, ValueError):
                os.fsync(inner.fileno())


def parent(path: str) -> str:
    return path.rsplit("/", 1)[0]
