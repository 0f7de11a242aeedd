"""A checkpoint's layer as a shared, read-only overlay lower layer: ``fork`` without copies.

Docker's overlay2 driver builds a container's ``lowerdir`` at every mount from the
layer's ``lower`` file (``/var/lib/docker/overlay2/<id>/lower``: ``l/<link>`` entries,
uppermost first, each resolved under the driver's home). A fork is created (not started),
then ``l/<link>`` of one unpacked, verified copy of the checkpoint's layer is put at the
head of that file: the fork starts with an empty upperdir over the checkpoint's layer,
over the image. overlayfs honours the layer's whiteouts and opaque directories in a lower
layer, and copies a file up on its first write, so every fork writes only its own
upperdir: forking costs one unpack per checkpoint, not one per fork. The unpack runs on a
thread (``Making``) while the forks' containers are created and attached to the copy's
link (dangling until the copy is published); no fork starts before the copy is verified.

Where: its ``diff`` is a tmpfs of its own when the layer fits (``in_memory.memory_cap``:
the tar's size at most ``in_memory.MEMORY_MAX_BYTES`` and its cap, 4x the tar, at most
1/8 of the host's available memory; ``$BELAYER_FORK_LOWER``: ``auto``, ``memory``,
``disk``), else (or when no tmpfs can be mounted, or the layer overflows it) a directory
on Docker's disk. Creating a few thousand files on Docker's ext4 took 0.4-4 s on the dev
VM (and varied with what else wrote to it), into tmpfs about 0.1 s; the price is the
layer's unpacked size in host memory while a fork uses it.

Lifetime: the copy lives in ``<docker root>/belayer-lowers/<name>`` (not the store: its
retention may delete the checkpoint), its link is ``overlay2/l/<link>``; every fork is
labelled ``belayer.shared-lower=<name>`` (a fork started in a container created ahead,
``belayer_env.forks.pool``, carries an alias instead: ``alias-...``, a symlink beside the copy,
made when the fork takes that container). It is never written once ready; an in-memory
one is ready only while its tmpfs is mounted (not after a reboot: a capture of such a
fork then fails, as for a swept copy). ``sweep`` (``belayer gc``, and every ``fork``)
unmounts and removes a copy and its link when no container, in any state, carries its
label or an alias of it and no fork is being made from it (and an alias no container carries) (a fork holds a shared ``flock`` on the copy's
directory, the maker from before it publishes the copy, a reuser from before it checks
the copy, until its containers exist; ``sweep`` takes it exclusively, without waiting).

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
import fcntl
import os
import re
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker

from belayer_env.store import in_memory, layer
from belayer_env.store.manifest import Checkpoint
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
_creating = threading.Lock()
_unshareable: set[str] = set()
"""Names of layers this process found hardlinked files in: not unpacked again to learn it."""


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


class Unshareable(layer.LayerError):
    """The layer has hardlinked files: it cannot be a shared lower layer (see the module)."""


class Making(SharedLower):
    """A shared copy being unpacked and verified on a thread while the forks are created.

    Its name and link are fixed up front, so a created fork can be attached to it before it
    exists (the link dangles until then; nothing starts before ``wait_ready``). The maker
    takes the shared ``flock`` on the copy's directory before publishing it and holds it
    until ``close``: ``sweep`` never sees it unheld while the forks are being made.
    """

    def __init__(self, ck: Checkpoint, root: Path, manifest: dict[str, Any]):
        super().__init__(root, f"{LINK_PREFIX}{uuid.uuid4().hex[:19].upper()}")
        self.error: BaseException | None = None
        self._fd: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ck, manifest), daemon=True,
                                        name="belayer-fork-layer")
        self._thread.start()

    def _run(self, ck: Checkpoint, manifest: dict[str, Any]) -> None:
        try:  # the caller took ``_creating`` for us: one maker per process at a time
            self._fd = _make(ck, self.root, manifest, self.link())
            if (self.root / "unshareable").is_file():
                _unshareable.add(self.name)
                raise Unshareable(f"the layer of {ck.id} has hardlinked files")
        except BaseException as e:  # noqa: BLE001 - reported by wait_ready
            self.error = e
        finally:
            _creating.release()
            self._done.set()

    def wait_ready(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error
        super().wait_ready()

    def close(self) -> None:
        self._thread.join()  # never leave a half-made copy behind a failed fork
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def lease(client: docker.DockerClient, ck: Checkpoint, docker_root: str | Path,
          manifest: dict[str, Any], digest: str) -> Iterator[SharedLower | None]:
    """The shared copy of ``ck``'s layer, held against ``sweep`` while the caller creates
    its forks: one this process made before (ready), else a ``Making`` one (unpacked and
    verified on a thread: the caller calls ``wait_ready`` before starting anything on it;
    ``Unshareable`` when the layer has hardlinked files, ``LayerError`` when it disagrees
    with the manifest). None when the layer is known to have hardlinked files."""
    base = lowers_root(docker_root)
    base.mkdir(mode=0o700, exist_ok=True)
    name = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', ck.id)[:80]}-{digest[:12]}~{owner_tag()}"
    root = base / name
    for _ in range(3):
        if name in _unshareable:
            yield None
            return
        _creating.acquire()
        if not SharedLower(root).ready() and not (root / "unshareable").is_file():
            try:
                making = Making(ck, root, manifest)  # releases _creating when made
            except BaseException:
                _creating.release()
                raise
            try:
                yield making
            finally:
                making.close()
            return
        _creating.release()
        if (root / "unshareable").is_file():
            _unshareable.add(name)
            continue
        fd = open_dir(root)
        if fd is None:
            continue  # swept between its check and our lock: make it again
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if SharedLower(root).ready() and os.fstat(fd).st_ino == os.stat(root).st_ino:
                yield SharedLower(root)
                return
        finally:
            os.close(fd)
    raise layer.LayerError(f"the shared copy {root} kept disappearing while forking (a concurrent gc?)")


def open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None


def _make(ck: Checkpoint, root: Path, manifest: dict[str, Any], link: str) -> int:
    """Unpack + verify ``ck``'s layer into a fresh directory (a tmpfs of its own where it
    fits, ``in_memory.memory_cap``), list it, lock it (shared ``flock``, returned: the caller closes
    it), publish it under ``root`` (rename), link it, and mark it ready (last)."""
    remove_copy(root)  # half made by this process before (an error), or in memory before a reboot
    tmp = root.with_name(f".new-{uuid.uuid4().hex[:12]}~{owner_tag()}")
    tmp.mkdir(mode=0o700)
    fd: int | None = None
    try:
        (tmp / "diff").mkdir(mode=0o755)
        src = Path(ck.path) / "layer.tar"
        cap = in_memory.memory_cap(src.stat().st_size)
        if cap is not None and in_memory.try_mount_tmpfs(tmp / "diff", cap, source=in_memory.FORK):
            (tmp / IN_MEMORY).write_text(f"{cap}\n")
        else:
            cap = None
        try:
            layer.install(src, tmp / "diff", manifest["files"]["layer.tar"])
        except layer.LayerError:
            if cap is None:
                raise
            # full (a layer of many tiny files?) or corrupt: once more, on disk, to know which
            in_memory.umount(tmp / "diff")
            (tmp / IN_MEMORY).unlink()
            shutil.rmtree(tmp / "diff")
            (tmp / "diff").mkdir(mode=0o755)
            layer.install(src, tmp / "diff", manifest["files"]["layer.tar"])
        proc = subprocess.run(["find", str(tmp / "diff"), "-printf", r"%y %n %P\0"], capture_output=True)
        if proc.returncode != 0:
            raise layer.LayerError(f"listing {tmp / 'diff'} failed: {proc.stderr.decode(errors='replace')[-300:]}")
        listing = [e for e in proc.stdout.split(b"\0") if e]
        if any(e[:1] == b"f" and int(e.split(b" ", 2)[1]) > 1 for e in listing):
            (tmp / "unshareable").write_text("hardlinked files\n")
            in_memory.umount(tmp / "diff")
            (tmp / IN_MEMORY).unlink(missing_ok=True)
            shutil.rmtree(tmp / "diff")
        else:
            (tmp / ENTRIES).write_bytes(b"".join(e[:2] + e.split(b" ", 2)[2] + b"\0" for e in listing))
            (tmp / LINK_FILE).write_text(link)
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_SH)  # held from before its publication: sweep skips it
        os.rename(tmp, root)
    except BaseException:
        if fd is not None:
            os.close(fd)
        remove_copy(tmp)
        raise
    try:
        if (root / LINK_FILE).is_file():
            # Docker resolves each lower entry under its overlay2 home, and a link's target
            # under overlay2/l (getLowerDirs): the target is relative to that directory
            target = f"../../{LOWERS_DIR}/{root.name}/diff"
            os.symlink(target, root.parent.parent / "overlay2" / "l" / link)
            (root / READY).write_text("")
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_copy(path: Path) -> None:
    """Remove a shared copy (made or half made), its tmpfs unmounted first."""
    with contextlib.suppress(OSError):
        in_memory.umount(path / "diff")
    shutil.rmtree(path, ignore_errors=True)
