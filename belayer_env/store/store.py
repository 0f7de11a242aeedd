"""``CheckpointStore``: a 0700 directory of published checkpoints, by sandbox.

Layout: ``<root>/<sandbox>/<id>/`` (manifest.json + artifacts), ``<root>/.staging/`` for
checkpoints being written, ``<root>/.trash/`` for ones being removed, ``<root>/.locks/``,
``<root>/.mirrors/`` (each sandbox's layer as of its last capture: what an incremental
capture compares against; a cache, never needed to restore).
A checkpoint appears under ``<sandbox>/`` only by one ``rename`` of a fully written and
fsynced staging directory, so a crash at any point leaves either nothing or the whole
thing. Staging entries carry their writer's (pid, start time); ``clean_incomplete`` removes
those whose writer is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from belayer_core.errors import CheckpointFailed, CheckpointNotFound, ConfigError, UsageError
from belayer_core.procfs import OwnerId
from belayer_core.procfs import owner_alive as _label_owner_alive
from belayer_env.sandbox.config import parse_size
from belayer_env.store import scratch as scratch_space
from belayer_env.store.manifest import Checkpoint, checkpoint_from_manifest, read_manifest
from belayer_env.store.names import is_plain, sandbox_of
from belayer_env.store.private_dir import ensure_private_dir, ensure_shared_base

STAGING, TRASH, LOCKS, MIRRORS = ".staging", ".trash", ".locks", ".mirrors"
DEFAULT_SCRATCH = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
DEFAULT_MAX_LAYER_BYTES = 2**30


def default_max_layer_bytes() -> int:
    """``$BELAYER_MAX_LAYER_BYTES`` (a size: ``512m``, ``2g``), else 1 GiB."""
    raw = os.environ.get("BELAYER_MAX_LAYER_BYTES")
    if not raw:
        return DEFAULT_MAX_LAYER_BYTES
    try:
        return parse_size(raw)
    except ValueError as e:
        raise ConfigError(f"BELAYER_MAX_LAYER_BYTES: {e}") from e


def default_store_path() -> Path:
    """``$BELAYER_CHECKPOINTS``, else ``$BELAYER_HOME/checkpoints``, else ~/.belayer/checkpoints."""
    if os.environ.get("BELAYER_CHECKPOINTS"):
        return Path(os.environ["BELAYER_CHECKPOINTS"])
    home = os.environ.get("BELAYER_HOME") or os.path.join(os.path.expanduser("~"), ".belayer")
    return Path(home) / "checkpoints"


def owner_tag() -> str:
    """This process's ``OwnerId`` label: names temporary dirs (``<name>~<tag>``) so orphans are known."""
    return OwnerId.current().to_label()


def owner_alive(name: str) -> bool:
    """Whether the process named by the ``~<pid>-<ticks>`` suffix of ``name`` still runs."""
    return _label_owner_alive(name.rpartition("~")[2])


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """Published checkpoints under ``path``; ``keep`` newest per sandbox (None: keep all).

    ``scratch`` is where the frozen part writes (tmpfs by default, so the freeze never
    waits on a disk: ``/dev/shm/belayer-scratch``, a large-folio tmpfs of its own where it
    can be, see ``checkpoint.scratch``); the artifacts are copied, hashed and fsynced into
    ``path`` after thaw.
    ``max_layer_bytes`` bounds what one capture may put there and on the store's disk: a
    bigger writable layer fails the checkpoint (``CheckpointFailed`` naming the limit) before
    the sandbox is frozen. ``create=False`` opens an existing store and creates nothing (a
    missing one is a ``UsageError``): what read-only commands use.

    The store and its scratch root must be this user's and writable by no one else, below
    directories that only root or this user can change (``private_dir``: ``ConfigError``
    naming the directory otherwise): whoever writes a store decides what a restore starts.
    Checkpoint and sandbox directories that are symlinks, or whose manifest names another
    checkpoint, are not checkpoints.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, keep: int | None = 3,
                 scratch: str | os.PathLike[str] | None = None, *, create: bool = True,
                 max_layer_bytes: int | None = None):
        if keep is not None and keep < 1:
            raise UsageError(f"keep must be >= 1 or None, got {keep}")
        self.path = Path(path) if path is not None else default_store_path()
        self.keep = keep
        self.max_layer_bytes = default_max_layer_bytes() if max_layer_bytes is None else max_layer_bytes
        if self.max_layer_bytes < 1:
            raise UsageError(f"max_layer_bytes must be >= 1, got {self.max_layer_bytes}")
        base = Path(scratch) if scratch is not None else DEFAULT_SCRATCH
        self.scratch_root = base / "belayer-scratch" if base is not None else self.path / ".scratch"
        if not create:
            if not self.path.is_dir():
                what = "is not a directory" if self.path.exists() else "does not exist"
                raise UsageError(f"no checkpoint store at {self.path} (it {what})")
            ensure_private_dir(self.path, "checkpoint store", create=False)
            return
        ensure_private_dir(self.path, "checkpoint store")
        for sub in (STAGING, TRASH, LOCKS):
            ensure_private_dir(self.path / sub, "checkpoint store directory")
        if base is not None:
            ensure_shared_base(base, "scratch directory")
        ensure_private_dir(self.scratch_root, "scratch directory")
        if base is not None and base == DEFAULT_SCRATCH:
            scratch_space.prepare(self.scratch_root)  # its own large-folio tmpfs where it can

    # ------------------------------------------------------------------ writing

    def new_staging(self, checkpoint_id: str) -> Path:
        d = self.path / STAGING / f"{checkpoint_id}~{owner_tag()}"
        d.mkdir(mode=0o700)
        return d

    def new_scratch(self, checkpoint_id: str) -> Path:
        return scratch_space.new_dir(self.scratch_root, f"{checkpoint_id}~{owner_tag()}")

    def publish(self, staging: Path, sandbox: str, checkpoint_id: str) -> Checkpoint:
        """Atomically move a fully written, fsynced staging dir into place."""
        try:
            if sandbox_of(checkpoint_id) != sandbox:
                raise ValueError(f"checkpoint id {checkpoint_id!r} is not of sandbox {sandbox!r}")
        except ValueError as e:
            raise UsageError(f"cannot publish: {e}") from e
        parent = self.path / sandbox
        parent.mkdir(mode=0o700, exist_ok=True)
        if parent.is_symlink():
            raise CheckpointFailed(f"{parent} is a symlink, not a sandbox directory of the store: not publishing")
        final = parent / checkpoint_id
        fsync_dir(staging)
        os.rename(staging, final)
        fsync_dir(parent)
        fsync_dir(self.path / STAGING)
        return checkpoint_from_manifest(final, read_manifest(final))

    def mirror_dir(self, sandbox: str) -> Path:
        """This process's mirror of ``sandbox``'s layer (see ``incremental``)."""
        return self.path / MIRRORS / f"{sandbox}~{owner_tag()}"

    def drop_mirror(self, sandbox: str) -> None:
        """Forget the mirror of ``sandbox`` (its next capture copies the whole layer)."""
        shutil.rmtree(self.mirror_dir(sandbox), ignore_errors=True)

    @contextlib.contextmanager
    def lock(self, sandbox: str) -> Iterator[None]:
        """One checkpoint of a sandbox at a time (across processes; released on death)."""
        if not is_plain(sandbox):
            raise UsageError(f"invalid sandbox name {sandbox!r}")
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(self.path / LOCKS / f"{sandbox}.lock", flags, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise CheckpointFailed(f"another checkpoint of sandbox {sandbox} is in progress") from e
            yield
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ reading

    def list(self, sandbox: str | None = None) -> list[Checkpoint]:
        """Published checkpoints, oldest first (by sandbox, step, creation time)."""
        out = []
        if sandbox is not None and not is_plain(sandbox):
            raise UsageError(f"invalid sandbox name {sandbox!r}")
        dirs = [self.path / sandbox] if sandbox else [d for d in self.path.iterdir() if not d.name.startswith(".")]
        for sdir in dirs:
            if sdir.is_symlink() or not sdir.is_dir():
                continue  # a symlink was never made by the store: it would list another's checkpoints
            for cdir in sdir.iterdir():
                try:
                    out.append(self._load(cdir))
                except (ValueError, KeyError, TypeError, ConfigError):
                    continue  # not a checkpoint (never published that way); ignore
        return sorted(out, key=lambda c: (c.sandbox, c.step, c.created))

    def latest(self, sandbox: str) -> Checkpoint | None:
        found = self.list(sandbox)
        return found[-1] if found else None

    def get(self, checkpoint_id: str) -> Checkpoint:
        try:
            sandbox = sandbox_of(checkpoint_id)
        except ValueError as e:
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id!r} in {self.path}: {e}") from e
        cdir = self.path / sandbox / checkpoint_id
        if not cdir.is_dir():
            raise CheckpointNotFound(f"no checkpoint {checkpoint_id!r} in {self.path}")
        try:
            return self._load(cdir)
        except (ValueError, KeyError, TypeError, ConfigError) as e:
            raise CheckpointNotFound(f"checkpoint {checkpoint_id!r} refused: {e}") from e

    @staticmethod
    def _load(cdir: Path) -> Checkpoint:
        """The checkpoint published at ``cdir``: a real directory (never a symlink to another
        checkpoint) whose manifest names exactly this id and sandbox."""
        if cdir.is_symlink() or cdir.parent.is_symlink():
            raise ValueError(f"{cdir} is a symlink, not a published checkpoint")
        ck = checkpoint_from_manifest(cdir, read_manifest(cdir))
        if ck.id != cdir.name or ck.sandbox != cdir.parent.name:
            raise ValueError(f"{cdir} holds the manifest of checkpoint {ck.id!r} of {ck.sandbox!r}")
        return ck

    def next_step(self, sandbox: str) -> int:
        """The number ``full_checkpoint`` gives a checkpoint taken without a step: one past
        the newest of ``sandbox`` (1 for the first)."""
        newest = self.latest(sandbox)
        return 1 if newest is None else newest.step + 1

    def total_bytes(self, sandbox: str | None = None) -> int:
        return sum(c.size_bytes for c in self.list(sandbox))

    # ------------------------------------------------------------------ removing

    def remove(self, checkpoint_id: str) -> None:
        """Remove one checkpoint: renamed out of sight first, so it is never half there."""
        c = self.get(checkpoint_id)
        (self.path / TRASH).mkdir(mode=0o700, exist_ok=True)
        trash = self.path / TRASH / f"{c.id}~{uuid.uuid4().hex[:8]}"
        os.rename(c.path, trash)
        fsync_dir(c.path.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def prune(self, sandbox: str, keep: int | None = None) -> list[str]:
        """Keep the newest ``keep`` (default: the store's) checkpoints of ``sandbox``."""
        keep = self.keep if keep is None else keep
        if keep is None or keep < 0:
            return []
        old = self.list(sandbox)[:-keep] if keep > 0 else self.list(sandbox)  # keep=0: all go
        for c in old:
            self.remove(c.id)
        return [c.id for c in old]

    def clean_incomplete(self) -> list[str]:
        """Remove staging/scratch left by dead writers and any trash; return what went."""
        removed = []
        for base in (self.path / STAGING, self.scratch_root, self.path / MIRRORS):
            for d in _entries(base):
                if not owner_alive(d.name):
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(str(d))
        for d in _entries(self.path / TRASH):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
        return removed

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.path)!r}, keep={self.keep})"


def _entries(directory: Path) -> list[Path]:
    """Entries of ``directory``; none when it does not exist (a store opened with create=False)."""
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []
