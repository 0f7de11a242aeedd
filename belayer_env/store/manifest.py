"""What a published checkpoint is: the ``Checkpoint`` record and its on-disk manifest.

The manifest (``manifest.json``) is written last, inside the staging directory, and lists
every artifact with its size and sha256. A directory without a valid manifest is never a
checkpoint; a file whose size or hash disagrees with it makes the checkpoint unusable. Its
names are checked on every read (``names``): an entry is the layer or ``runtime/<plain
name>``, its id and sandbox are plain names, so no manifest can point outside its directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from belayer_env.sandbox.config import SandboxConfig
from belayer_env.store.names import check_files, check_plain, sandbox_of

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 1 << 20


@dataclass(frozen=True)
class Checkpoint:
    """A published, complete checkpoint of one sandbox at one action boundary."""

    id: str
    sandbox: str
    step: int
    path: Path
    created: float
    frozen_s: float
    total_s: float
    size_bytes: int
    has_runtime: bool
    config: SandboxConfig


def copy_hashed(src: BinaryIO, dst: BinaryIO) -> tuple[int, str]:
    """Copy ``src`` to ``dst`` in one pass, returning (size, sha256 hex)."""
    h = hashlib.sha256()
    size = 0
    while chunk := src.read(CHUNK):
        h.update(chunk)
        dst.write(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def write_manifest(directory: Path, data: dict[str, Any]) -> None:
    """Write ``manifest.json`` durably (fsync) into ``directory``."""
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": FORMAT, **data}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse a checkpoint's manifest; ``ValueError`` if missing, unreadable or foreign."""
    return read_manifest_digest(directory)[0]


def read_manifest_digest(directory: Path) -> tuple[dict[str, Any], str]:
    """``read_manifest`` plus the sha256 of the very bytes parsed (what a staged copy matches)."""
    try:
        raw = (directory / MANIFEST).read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ValueError(f"no valid {MANIFEST} in {directory}: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or "files" not in data:
        raise ValueError(f"{directory / MANIFEST} is not a belayer checkpoint manifest (format {FORMAT})")
    try:
        check_files(data["files"])
        if sandbox_of(data.get("id")) != check_plain("sandbox name", data.get("sandbox")):
            raise ValueError(f"checkpoint id {data.get('id')!r} does not belong to sandbox {data.get('sandbox')!r}")
    except ValueError as e:
        raise ValueError(f"{directory / MANIFEST} refused: {e}") from e
    return data, hashlib.sha256(raw).hexdigest()


def checkpoint_from_manifest(directory: Path, data: dict[str, Any]) -> Checkpoint:
    return Checkpoint(
        id=data["id"],
        sandbox=data["sandbox"],
        step=int(data["step"]),
        path=directory,
        created=float(data["created"]),
        frozen_s=float(data["frozen_s"]),
        total_s=float(data["total_s"]),
        size_bytes=int(data["size_bytes"]),
        has_runtime=bool(data["has_runtime"]),
        config=SandboxConfig(**data["config"]),
    )


def check_file(rel: str, meta: dict[str, Any], size: int, digest: str) -> None:
    if size != meta["size"]:
        raise ValueError(f"{rel}: size {size} != {meta['size']} in the manifest")
    if digest != meta["sha256"]:
        raise ValueError(f"{rel}: sha256 mismatch (corrupt)")

