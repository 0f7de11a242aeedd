"""A fork's hold on the shared copy of its checkpoint's layer: one made before, or made now.

``lease`` yields the copy while the caller creates its forks, held against ``sweep``
(``shared_sweep``) by a shared ``flock`` on the copy's directory: the maker's from before it
publishes the copy, a reuser's from before it checks the copy, until the forks' containers
exist. A copy this process has not made yet is made on a thread (``Making``) while the
forks' containers are created and attached to its link (dangling until the copy is
published); no fork starts before the copy is verified (``wait_ready``). One maker per
process at a time.

Where: its ``diff`` is a tmpfs of its own when the layer fits (``in_memory.memory_cap``:
the tar's size at most ``in_memory.MEMORY_MAX_BYTES`` and its cap, 4x the tar, at most
1/8 of the host's available memory; ``$BELAYER_FORK_LOWER``: ``auto``, ``memory``,
``disk``), else (or when no tmpfs can be mounted, or the layer overflows it) a directory
on Docker's disk. Creating a few thousand files on Docker's ext4 took 0.4-4 s on the dev
VM (and varied with what else wrote to it), into tmpfs about 0.1 s; the price is the
layer's unpacked size in host memory while a fork uses it. A layer with hardlinked files
is ``Unshareable`` (``shared_layer``): its forks get a copy each.
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
from belayer_env.store.shared_layer import (
    ENTRIES,
    IN_MEMORY,
    LINK_FILE,
    LINK_PREFIX,
    LOWERS_DIR,
    READY,
    SharedLower,
    lowers_root,
    open_dir,
    remove_copy,
)
from belayer_env.store.store import owner_tag

_creating = threading.Lock()
_unshareable: set[str] = set()
"""Names of layers this process found hardlinked files in: not unpacked again to learn it."""


class Unshareable(layer.LayerError):
    """The layer has hardlinked files: it cannot be a shared lower layer (``shared_layer`` says why)."""


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
            self._fd = make_copy(ck, self.root, manifest, self.link())
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



def make_copy(ck: Checkpoint, root: Path, manifest: dict[str, Any], link: str) -> int:
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
