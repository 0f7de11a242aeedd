"""A restore's artifacts on Docker's disk: the layer unpacked and the CRIU images linked or
copied, each verified against the manifest before anything is started from it (``Staged``),
or borrowed from a pre-staged or forked copy that was verified already (``Borrowed``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from belayer_core.errors import RestoreFailed
from belayer_env.criu import runtime
from belayer_env.restore import ctrd_copies, prestaging
from belayer_env.store import in_memory, layer
from belayer_env.store.manifest import Checkpoint
from belayer_env.store.store import owner_tag

RESTORE_NAME = "belayer"  # Docker's checkpoint name inside the new container's directory
LINKS_PREFIX = ".links-"
"""A restore's linked images directory beside in-memory images (``_Staged.links``)."""
LINK_UP = "../" * 64
"""Prefix of every image link: containerd unpacks the checkpoint directory into a temporary
directory of its own (depth unknown here), and ``..`` at ``/`` stays at ``/``."""


class Staged:
    """Runs ``fill(dir)`` on a thread into a fresh dir under ``tmp``; ``move_to`` renames it.

    ``Staged.ready(dir)``: content already there and verified (a claimed pre-staged copy).
    """

    def __init__(self, ck: Checkpoint, what: str, tmp: Path, fill: Callable[[Path], None] | None):
        self.ck, self.what = ck, what
        self.dir = tmp / f"belayer-restore-{uuid.uuid4().hex[:12]}~{owner_tag()}"
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if fill is not None:
            self._thread = threading.Thread(target=self._run, args=(fill,), daemon=True, name="belayer-restore-stage")
            self._thread.start()

    @classmethod
    def ready(cls, ck: Checkpoint, what: str, directory: Path) -> Staged:
        """Content already unpacked and verified (a claimed pre-staged copy)."""
        self = cls(ck, what, directory.parent, None)
        self.dir = directory
        return self

    @classmethod
    def borrowed(cls, ck: Checkpoint, what: str, src: Path | concurrent.futures.Future[Path]) -> Staged:
        """Content verified by someone else (``fork``: the images once for every fork), who
        keeps and removes it: used where it is, never moved or discarded here."""
        return Borrowed(ck, what, src)

    def _run(self, fill: Callable[[Path], None]) -> None:
        try:
            self.dir.mkdir(mode=0o700, parents=True)
            fill(self.dir)
        except BaseException as e:  # noqa: BLE001 - reported by move_to
            self.error = e

    def verified(self) -> None:
        """Wait for the unpack; ``RestoreFailed`` naming the artifact if it disagreed with
        the manifest (or was missing)."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise RestoreFailed(f"checkpoint {self.ck.id}: {self.what} unusable: {short_error(self.error)}",
                                checkpoint=self.ck.id) from self.error

    def move_to(self, dest: Path) -> None:
        """Put the verified content at ``dest`` (a dir there holding only empty dirs is replaced:
        Docker creates a working dir missing from the image in a new container's upperdir)."""
        self.verified()
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if dest.is_dir():
            remove_empty_tree(dest)
        try:
            os.rename(self.dir, dest)
        except OSError as e:  # a capped sandbox layer is a file system of its own (belayer_env.sandbox.disk),
            if e.errno not in (errno.EXDEV, errno.EBUSY):  # and the unpack may be a tmpfs (a mount)
                raise
            dest.mkdir(mode=0o755)
            layer.copy_tree(self.dir, dest)

    def links(self, tmp: Path) -> tuple[Path, str]:
        """A directory of links to the verified files (``link_into``) and its nonce. Where
        the files are in memory (a tmpfs of their own), the directory is made there,
        ``<files>/.links-<id>/<RESTORE_NAME>``, and the container's checkpoints directory
        becomes a symlink to its parent (``point_checkpoints_at``): on the dev VM's ext4 a
        symlink cost ~0.4 ms of CPU, 60-90 of them per restore with the spent directory's
        removal (a third of ``fork(ck, 8)``'s own CPU). Else in Docker's tmp dir, on its
        disk, for a rename into the container's checkpoints directory."""
        self.verified()
        if os.stat(self.dir).st_dev != os.stat(tmp).st_dev:
            dest = self.dir / f"{LINKS_PREFIX}{uuid.uuid4().hex[:12]}" / RESTORE_NAME
            dest.parent.mkdir(mode=0o700)
        else:
            dest = tmp / f"{prestaging.PREFIX}{uuid.uuid4().hex[:12]}~{owner_tag()}"
        try:
            return dest, self.link_into(dest)
        except BaseException:
            remove_links(dest)
            raise

    def link_into(self, dest: Path) -> str:
        """Make ``dest`` a directory of relative symlinks to the verified files, which stay
        here until ``discard`` (after the restore), and a nonce (returned). The links are
        valid from any directory of the same file system (``LINK_UP``): ``dest`` may be renamed."""
        self.verified()
        dest.mkdir(mode=0o700, parents=True)
        here = str(self.dir.resolve())  # once: a file's own resolve walked the whole path again
        for f in os.scandir(self.dir):
            if f.name.startswith(LINKS_PREFIX):
                continue  # another restore's links (``links``)
            os.symlink(f"{LINK_UP}{here.lstrip('/')}/{f.name}", dest / f.name)
        return ctrd_copies.write_nonce(dest)

    def discard(self) -> None:
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError):
            in_memory.umount(self.dir)  # an in-memory unpack (``unpack_layer``)
        shutil.rmtree(self.dir, ignore_errors=True)


def install_images(ck: Checkpoint, data: dict[str, Any], d: Path) -> None:
    """The runtime images, verified, into ``d``: hardlinks where the store is on the same
    mount as Docker's tmp dir (only read, to hash them), else copies, into a tmpfs of its
    own where they fit (as ``fork`` does): a heavy sandbox's 54 MB of pages written onto
    Docker's disk was on the restore's critical path, and then left dirty for the next
    restore's fsyncs (``writeback``)."""
    src = Path(ck.path)
    size = sum(m["size"] for rel, m in data["files"].items() if rel.startswith("runtime/"))
    if not same_mount(src / "manifest.json", d) and (cap := in_memory.memory_cap(size)) is not None:
        in_memory.try_mount_tmpfs(d, cap, source=in_memory.RESTORE, mode="0700")
    runtime.install(src, data["files"], d)


def same_mount(src: Path, d: Path) -> bool:
    """Whether a file of ``src``'s can be hardlinked into ``d`` (not across mounts: EXDEV)."""
    probe = d / ".link-probe"
    try:
        os.link(src, probe)
    except OSError:
        return False
    probe.unlink()
    return True


def unpack_layer(ck: Checkpoint, data: dict[str, Any], d: Path) -> None:
    """Unpack + verify the layer into ``d``. A capped sandbox's layer is copied into its own
    file system afterwards anyway, so it is unpacked into a tmpfs of its own where it fits
    (``in_memory.memory_cap``): creating thousands of files on Docker's ext4 cost seconds
    of kernel time on the dev VM, into tmpfs ~0.1 s."""
    tar = Path(ck.path) / "layer.tar"
    if ck.config.disk_bytes is not None and (cap := in_memory.memory_cap(tar.stat().st_size)) is not None:
        in_memory.try_mount_tmpfs(d, cap, source=in_memory.RESTORE, mode="0700")
    layer.install(tar, d, data["files"]["layer.tar"])


def result_of(src: Path | concurrent.futures.Future[Path]) -> Path:
    return src.result() if isinstance(src, concurrent.futures.Future) else src


class Borrowed(Staged):
    """``Staged.borrowed``: another's verified directory (or the future of one)."""

    def __init__(self, ck: Checkpoint, what: str, src: Path | concurrent.futures.Future[Path]):
        super().__init__(ck, what, Path("/nonexistent"), None)
        self._src = src

    def verified(self) -> None:
        try:
            self.dir = result_of(self._src)
        except Exception as e:
            raise RestoreFailed(f"checkpoint {self.ck.id}: {self.what} unusable: {short_error(e)}",
                                checkpoint=self.ck.id) from e

    def move_to(self, dest: Path) -> None:
        """Links to the files at ``dest`` (they stay with their owner)."""
        self.verified()
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        dest.mkdir(mode=0o700)
        link_all(self.dir, dest)

    def discard(self) -> None:
        """Nothing: the owner removes the files."""


def point_checkpoints_at(own: Path, links: Path) -> bool:
    """Make a created container's checkpoints directory (``own``, empty since its create)
    a symlink to ``links``: Docker resolves ``<own>/<checkpoint name>`` through it, tars what
    it finds there for containerd, and removes only the symlink with the container. Docker
    20.10 refuses a custom ``checkpoint-dir`` with containerd. False if ``own`` holds anything."""
    try:
        own.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    os.symlink(links, own)
    return True


def unpoint(own: Path) -> None:
    """After the start: the container's checkpoints directory an empty directory again, as
    Docker made it (its own ``docker checkpoint create`` would fail on a dangling symlink)."""
    if own.is_symlink():
        own.unlink()
        own.mkdir(mode=0o700)


def in_memory_links(link_dir: Path) -> bool:
    return link_dir.parent.name.startswith(LINKS_PREFIX)


def remove_links(link_dir: Path) -> None:
    shutil.rmtree(link_dir.parent if in_memory_links(link_dir) else link_dir, ignore_errors=True)


def link_all(src: Path, dest: Path) -> None:
    """Hardlink every file of ``src`` into ``dest``; symlink where ``src`` is another file
    system (``fork``'s in-memory images, which outlive every fork's restore)."""
    other_fs = os.stat(src).st_dev != os.stat(dest).st_dev
    for f in src.iterdir():
        if f.name.startswith(LINKS_PREFIX):
            continue
        if other_fs:
            os.symlink(f, dest / f.name)
            continue
        try:
            os.link(f, dest / f.name)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            os.symlink(f, dest / f.name)


def remove_empty_tree(path: Path) -> None:
    """Remove ``path`` if it holds nothing but (empty) directories; ``OSError`` otherwise."""
    for sub in sorted((p for p in path.rglob("*")), key=lambda p: len(p.parts), reverse=True):
        sub.rmdir()  # a file, link or device there raises: never throw content away
    path.rmdir()


def short_error(e: BaseException) -> str:
    text = str(getattr(e, "explanation", "") or e).strip().splitlines()
    return text[-1][:600] if text else type(e).__name__
