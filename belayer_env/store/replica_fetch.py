"""Fetching a committed replica into a node's local store: every byte checked, then published.

The manifest must hash to what the replica's (signed) marker names and name that very
checkpoint; every file is downloaded into the store's staging directory under a checked
name (``names``: the layer or ``runtime/<plain name>``, created new, never through a link)
and checked against the manifest as it arrives. Only then is it published, by the base
``CheckpointStore.publish``: a replicated store must not upload what came from the replica.
A replica that fails any check is ``CheckpointNotFound``, and nothing of it stays.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from belayer_core.errors import CheckpointNotFound
from belayer_env.store.manifest import (
    MANIFEST,
    Checkpoint,
    check_file,
    copy_hashed,
    read_manifest_digest,
)
from belayer_env.store.names import check_entry
from belayer_env.store.replica_marker import Replica
from belayer_env.store.store import CheckpointStore


def download(fs: Any, base: str, rep: Replica, store: CheckpointStore) -> Checkpoint:
    """Download the replica at ``base`` (an fsspec path of ``fs``) into ``store``; return it there."""
    staging = store.new_staging(rep.id)
    try:
        raw = fs.cat_file(f"{base}/{MANIFEST}")
        if hashlib.sha256(raw).hexdigest() != rep.manifest_sha256:
            raise CheckpointNotFound(f"replica {rep.id}: manifest does not match its commit marker")
        (staging / MANIFEST).write_bytes(raw)
        try:
            data, _ = read_manifest_digest(staging)  # every name checked (``names``)
        except ValueError as e:
            raise CheckpointNotFound(f"replica {rep.id} refused: {e}") from e
        if (data["id"], data["sandbox"]) != (rep.id, rep.sandbox):
            raise CheckpointNotFound(f"replica {rep.id} refused: its manifest is of {data['id']!r}")
        for rel, meta in sorted(data["files"].items()):
            dest = _new_file(staging, check_entry(rel))
            with fs.open(f"{base}/{rel}", "rb") as src, open(dest, "wb") as dst:
                size, digest = copy_hashed(src, dst)
                dst.flush()
                os.fsync(dst.fileno())
            try:
                check_file(rel, meta, size, digest)
            except ValueError as e:
                raise CheckpointNotFound(f"replica {rep.id} is corrupt: {e}") from e
        # the base publish: a replicated store must not upload what came from the replica
        return CheckpointStore.publish(store, staging, rep.sandbox, rep.id)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _new_file(staging: Path, rel: str) -> Path:
    """``staging/rel`` created empty, never through a link (``rel``: a checked entry name)."""
    head, _, name = rel.rpartition("/")
    directory = staging / head if head else staging
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.is_symlink():
        raise CheckpointNotFound(f"{directory} is a symlink")
    os.close(os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    return directory / name
