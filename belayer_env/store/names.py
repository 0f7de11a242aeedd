"""What a checkpoint may call things: its entries are names, never paths.

A manifest (local, or fetched from a replica that other nodes write) lists the files of a
checkpoint; the code that fetches, uploads, verifies and installs them joins those names
to a directory of its own. A name such as ``/etc/x`` or ``runtime/../../x`` would make that
join point anywhere on the host (``dest / "/abs"`` is ``/abs``), so every name is checked
here before any of it is used: the layer (``layer.tar``) or ``runtime/<plain name>``, and
sandbox names and checkpoint ids that are one plain path component each.
"""

from __future__ import annotations

import re
from typing import Any

LAYER = "layer.tar"
RUNTIME = "runtime"
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,254}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def is_plain(name: object) -> bool:
    """One path component of safe characters: no ``/``, no leading ``.`` (so never ``..``)."""
    return isinstance(name, str) and _PLAIN.fullmatch(name) is not None


def check_plain(kind: str, name: object) -> str:
    """``name`` if ``is_plain``, else ``ValueError`` naming ``kind``."""
    if not is_plain(name):
        raise ValueError(f"{kind} {name!r} is not a plain name (letters, digits, '_.+-', not starting with '.')")
    return name  # type: ignore[return-value]


def check_entry(rel: object) -> str:
    """A checkpoint entry: ``layer.tar`` or ``runtime/<plain name>``; ``ValueError`` otherwise."""
    if rel == LAYER:
        return rel
    if isinstance(rel, str):
        head, sep, name = rel.partition("/")
        if head == RUNTIME and sep and is_plain(name):
            return rel
    raise ValueError(f"manifest entry {rel!r} is not a checkpoint artifact ({LAYER} or {RUNTIME}/<plain name>)")


def check_files(files: object) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``: every name an entry, every record a size and a sha256."""
    if not isinstance(files, dict):
        raise ValueError("manifest 'files' is not a mapping")
    for rel, meta in files.items():
        check_entry(rel)
        if not (isinstance(meta, dict) and isinstance(meta.get("size"), int) and not isinstance(meta["size"], bool)
                and meta["size"] >= 0 and isinstance(meta.get("sha256"), str) and _HEX64.fullmatch(meta["sha256"])):
            raise ValueError(f"manifest entry {rel!r} has no valid size and sha256")
    return files


def sandbox_of(checkpoint_id: object) -> str:
    """The sandbox a checkpoint id belongs to (``<sandbox>.<step>.<hex>``); ``ValueError`` otherwise."""
    parts = check_plain("checkpoint id", checkpoint_id).rsplit(".", 2)
    if len(parts) != 3:
        raise ValueError(f"checkpoint id {checkpoint_id!r} is not <sandbox>.<step>.<suffix>")
    return check_plain("sandbox name", parts[0])
