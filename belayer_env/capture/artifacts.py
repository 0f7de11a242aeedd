"""A capture's space checks and what it writes after thaw: every artifact copied into the
store's staging directory with sha256 on the way, then made durable in one ``syncfs``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from belayer_core.errors import CheckpointFailed
from belayer_env.sandbox import disk, writeback
from belayer_env.store.manifest import copy_hashed
from belayer_env.store.store import CheckpointStore


def check_space(sandbox: Any, info: dict[str, Any], store: CheckpointStore) -> None:
    """Refuse a capture whose layer is over the store's limit, or that the scratch space (RAM,
    by default) cannot hold: the layer plus process memory up to the sandbox's memory limit."""
    used = disk.usage(info)
    if used is not None and used > store.max_layer_bytes:
        raise CheckpointFailed(f"checkpoint of sandbox {sandbox.name} refused: its writable layer holds {used} bytes, "
                               f"over the checkpoint limit of {store.max_layer_bytes} bytes "
                               "(CheckpointStore.max_layer_bytes, $BELAYER_MAX_LAYER_BYTES)")
    layer_bound = store.max_layer_bytes if used is None else used
    check_free(store.scratch_root, layer_bound + sandbox.config.memory_bytes, "the capture scratch space")


def check_free(path: Path, need: int, what: str) -> None:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise CheckpointFailed(f"not enough space in {what} ({path}): {free} bytes free, the capture needs up to {need}")


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def write_artifacts(scratch: Path, staging: Path, with_layer: bool = True) -> dict[str, dict[str, Any]]:
    """Copy layer.tar (``with_layer``) and runtime/* into ``staging`` hashing on the way;
    make them (and anything already in ``staging``) durable."""
    files: dict[str, dict[str, Any]] = {}
    sources = [scratch / "layer.tar"] if with_layer else []
    if (scratch / "runtime").is_dir():
        (staging / "runtime").mkdir(mode=0o700)
        sources += sorted((scratch / "runtime").iterdir())
    for src in sources:
        rel = str(src.relative_to(scratch))
        with open(src, "rb") as fi, open(staging / rel, "wb") as fo:
            size, digest = copy_hashed(fi, fo)
        files[rel] = {"size": size, "sha256": digest}
    writeback.syncfs(staging)  # the store's file system in one call, not one fsync per image
    return files


def write_layer(staging: Path, tar: Callable[[BinaryIO], tuple[int, str]]) -> dict[str, dict[str, Any]]:
    """``layer.tar`` written by ``tar`` (returns its size and sha256) into ``staging``."""
    with open(staging / "layer.tar", "wb") as fo:
        size, digest = tar(fo)
    return {"layer.tar": {"size": size, "sha256": digest}}
