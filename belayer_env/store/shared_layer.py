"""A checkpoint's layer as a shared, read-only overlay lower layer: ``fork`` without copies.

Docker's overlay2 driver builds a container's ``lowerdir`` at every mount from the
layer's ``lower`` file (``/var/lib/docker/overlay2/<id>/lower``: ``l/<link>`` entries,
uppermost first, each resolved under the driver's home). A fork is created (not started),
then ``l/<link>`` of one unpacked, verified copy of the checkpoint's layer is put at the
head of that file: the fork starts with an empty upperdir over the checkpoint's layer,
over the image. overlayfs honours the layer's whiteouts and opaque directories in a lower
layer, and copies a file up on its first write, so every fork writes only its own
upperdir: forking costs one unpack per checkpoint, not one per fork. This module is what a
copy is and where it lives; ``shared_lease`` makes one (on a thread, in memory where it
fits) or reuses one, held against ``sweep`` (``shared_sweep``) while forks are made from it.

Lifetime: the copy lives in ``<docker root>/belayer-lowers/<name>`` (not the store: its
retention may delete the checkpoint), its link is ``overlay2/l/<link>``; every fork is
labelled ``belayer.shared-lower=<name>`` (a fork started in a container created ahead,
``belayer_env.forks.pool``, carries an alias instead: ``alias-...``, a symlink beside the copy,
made when the fork takes that container). It is never written once ready; an in-memory
one is ready only while its tmpfs is mounted (not after a reboot: a capture of such a
fork then fails, as for a swept copy). ``sweep`` (``belayer gc``, and every ``fork``)
unmounts and removes a copy and its link when no container, in any state, carries its
label or an alias of it and no fork is being made from it (and an alias no container
carries): a fork holds a shared ``flock`` on the copy's directory until its containers
exist (``shared_lease``); ``sweep`` takes it exclusively, without waiting.

What differs from a fork with its own copy (``fork(..., share=False)``): without
overlay's ``redirect_dir`` (off on this kernel and in Docker's mount), ``rename(2)`` of a
directory that the checkpoint's layer holds fails with EXDEV, as it already does for the
image's own directories (``mv`` and most tools copy instead). A layer with hardlinked
files is not shared (a write would copy up one name and split the link): those
checkpoints are forked with a copy each.

A disk-capped sandbox (``belayer_env.sandbox.disk``) shares too: its fork's upperdir is on a
capped file system of its own, the shared layer is not, so the cap bounds what the fork
writes itself (the checkpoint's layer is not counted again per fork); the host's disk is
protected as before (every writer is capped, the shared copy is written once, or is in
memory, bounded by its tmpfs cap).

A checkpoint of a fork records the shared layer merged with the fork's upperdir
(``tar_merged``): upper entries replace lower ones, upper whiteouts and non-directories
hide the lower subtree, opaque upper directories hide the lower children. Such a
checkpoint needs nothing of the shared copy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from belayer_env.store import in_memory, layer
from belayer_env.store.store import owner_tag

LABEL = "belayer.shared-lower"
LOWERS_DIR = "belayer-lowers"
LINK_PREFIX = "BELAYER"
READY = "ready"
ENTRIES = "entries"
LINK_FILE = "link"
IN_MEMORY = "in-memory"
"""Marker: ``diff`` is a tmpfs of its own (``in_memory.memory_cap``); ready only while it is mounted."""
ALIAS_PREFIX = "alias-"
"""A pooled fork's label names an alias (``belayer_env.forks.pool``): a symlink to the copy."""


class SharedLower:
    """One unpacked, verified checkpoint layer under ``<docker root>/belayer-lowers``."""

    def __init__(self, root: Path, link: str | None = None):
        self.root = root
        self.name = root.name
        self._link = link

    @property
    def diff(self) -> Path:
        return self.root / "diff"

    @property
    def labels(self) -> dict[str, str]:
        return {LABEL: self.name}

    def link(self) -> str:
        return self._link or (self.root / LINK_FILE).read_text().strip()

    def ready(self) -> bool:
        """Complete and verified; an in-memory copy also still mounted (not after a reboot)."""
        return (self.root / READY).is_file() and (
            not (self.root / IN_MEMORY).is_file() or os.path.ismount(self.diff))

    @property
    def in_memory(self) -> bool:
        return (self.root / IN_MEMORY).is_file()

    def wait_ready(self) -> None:
        """Return once the copy is verified and ready (at once here: a copy made before);
        ``LayerError`` if it is not (``Making``: its unpack failed, or ``Unshareable``)."""
        if not self.ready():
            raise layer.LayerError(f"the shared layer {self.name} is gone from {self.root}")

    def entries(self) -> list[tuple[str, str]]:
        """(type letter of ``find -printf %y``, path relative to the layer; ``.`` for its root)."""
        raw = (self.root / ENTRIES).read_bytes().split(b"\0")
        return [(e[:1].decode(), os.fsdecode(e[2:]) or ".") for e in raw if e]

    def attach(self, inspect: dict[str, Any]) -> None:
        """Put this layer at the head of a created (not started) container's lowers."""
        lower_file = layer.upper_dir(inspect).parent / "lower"
        entry = f"l/{self.link()}"
        old = lower_file.read_text().strip()
        if entry in old.split(":"):
            return
        tmp = lower_file.with_name(f".lower-{uuid.uuid4().hex[:8]}")
        tmp.write_text(f"{entry}:{old}" if old else entry)
        os.chmod(tmp, 0o644)
        os.replace(tmp, lower_file)


def make_alias(shared: SharedLower, alias: str) -> None:
    """Make ``alias`` (a pooled fork's label) name ``shared``: a relative symlink beside it.
    Made while the fork holds the copy's lease, so ``sweep`` sees it before it may judge
    the copy unused."""
    if not alias.startswith(ALIAS_PREFIX) or "/" in alias:
        raise layer.LayerError(f"{alias!r} is not a fork pool's alias")
    path = shared.root.parent / alias
    tmp = shared.root.parent / f".new-alias-{uuid.uuid4().hex[:8]}~{owner_tag()}"
    os.symlink(shared.root.name, tmp)
    os.replace(tmp, path)


def aliases_of(base: Path, name: str) -> list[str]:
    return [p.name for p in base.iterdir() if p.name.startswith(ALIAS_PREFIX) and p.is_symlink()
            and os.readlink(p) == name]


def lowers_root(docker_root: str | Path) -> Path:
    return Path(docker_root) / LOWERS_DIR


def of_container(inspect: dict[str, Any]) -> SharedLower | None:
    """The shared lower a container was forked onto (its label), or None; ``LayerError``
    if the label names a copy that is gone (its capture cannot be complete without it)."""
    name = ((inspect.get("Config") or {}).get("Labels") or {}).get(LABEL)
    if not name:
        return None
    if "/" in name or name.startswith("."):
        raise layer.LayerError(f"label {LABEL}={name!r} names no shared layer")
    upper = layer.upper_dir(inspect)  # <root>/overlay2/<id>/diff
    shared = SharedLower(lowers_root(upper.parents[2]) / name)
    if not shared.ready():
        raise layer.LayerError(f"the shared layer {name} this fork runs on is gone from {shared.root}")
    return shared


def open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None


def remove_copy(path: Path) -> None:
    """Remove a shared copy (made or half made), its tmpfs unmounted first."""
    with contextlib.suppress(OSError):
        in_memory.umount(path / "diff")
    shutil.rmtree(path, ignore_errors=True)
