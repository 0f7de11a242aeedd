"""Checkpoints that outlive a node: replicas of published checkpoints at an fsspec URL.

A node's ``CheckpointStore`` dies with the node. ``ReplicaLocation`` keeps a copy of each
checkpoint at a shared location (``file:///shared/dir``, ``s3://bucket/prefix``,
``gs://...``: any fsspec URL) and ``ReplicatedCheckpointStore`` is a ``CheckpointStore``
that uploads every checkpoint there *before* publishing it locally, so a checkpoint the env
calls ready is already off the node.

Layout at the URL (object stores have no atomic directory rename, so a commit marker):

    <url>/<sandbox>/<id>/manifest.json, layer.tar, runtime/...   the artifacts
    <url>/<sandbox>/<id>/episode.json                            what resuming needs (optional)
    <url>/<sandbox>/<id>.ready.json                              the commit marker, written last

The marker names the sha256 of the manifest (and of episode.json) and is written under a
temporary name and moved into place: one atomic object/rename. Readers list markers only,
so an upload cut short is invisible (``clean_incomplete`` reaps it). ``fetch`` downloads a
committed replica into a node's local store, checking every byte against the manifest, and
publishes it there: ``full_restore`` then restores it as any local checkpoint.

Trust: whoever can write the location can write a replica, so every marker carries an HMAC
under the cluster's key (``replica_auth``): a marker without one, or with a wrong one, is
refused, never fetched. Names in markers and manifests are checked (``names``): a fetch
writes only the layer and ``runtime/<plain name>`` under its own staging directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from belayer_core.errors import CheckpointFailed, CheckpointNotFound, UsageError
from belayer_env.store.manifest import (
    MANIFEST,
    Checkpoint,
    check_file,
    copy_hashed,
    read_manifest_digest,
)
from belayer_env.store.names import check_entry, check_plain, sandbox_of
from belayer_env.store.replica_auth import MAC_FIELD, ReplicaKey
from belayer_env.store.store import CheckpointStore, fsync_dir

MARKER_SUFFIX = ".ready.json"
EPISODE = "episode.json"
FORMAT = 1


@dataclass(frozen=True)
class Replica:
    """A committed replica: what its marker says."""

    id: str
    sandbox: str
    step: int
    created: float
    manifest_sha256: str
    episode_sha256: str | None


class ReplicaLocation:
    """Committed checkpoint replicas under one fsspec URL (``storage_options`` go to fsspec).

    ``key_file``: the cluster's replica key (``replica_auth``; default
    ``$BELAYER_REPLICA_KEY_FILE``): markers are signed with it and checked against it."""

    def __init__(self, url: str, *, key_file: str | os.PathLike[str] | None = None, **storage_options: Any):
        try:
            from fsspec.core import url_to_fs
        except ImportError as e:  # the `ray` extra installs it
            raise UsageError("replicated checkpoints need fsspec: pip install 'belayer[ray]'") from e
        if "://" not in url:
            raise UsageError(f"replica location must be a URL (file:///dir, s3://bucket/prefix), got {url!r}")
        self.key = ReplicaKey.load(key_file)
        self.url = url.rstrip("/")
        self.fs, root = url_to_fs(self.url, **storage_options)
        self.root = root.rstrip("/")
        self.local = "file" in _protocols(self.fs)
        self.fs.makedirs(self.root, exist_ok=True)
        if self.local:
            os.chmod(self.root, 0o700)

    # ------------------------------------------------------------------ writing

    def upload(self, directory: Path, episode: dict[str, Any] | None = None) -> Replica:
        """Copy a fully written checkpoint directory, then commit it with its marker.

        Every byte read is checked against the manifest on the way (a local copy that went
        bad is not replicated). ``CheckpointFailed`` when anything fails: nothing committed.
        """
        data, manifest_sha = read_manifest_digest(directory)
        ck_id, sandbox = data["id"], data["sandbox"]
        _check_name(sandbox)
        base = f"{self.root}/{sandbox}/{ck_id}"
        try:
            self.fs.makedirs(base, exist_ok=True)
            for rel, meta in sorted(data["files"].items()):
                self.fs.makedirs(_parent(f"{base}/{rel}"), exist_ok=True)
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
                for d in {_parent(f"{base}/{rel}") for rel in data["files"]} | {base}:
                    fsync_dir(Path(d))
            marker = Replica(ck_id, sandbox, int(data["step"]), time.time(), manifest_sha, episode_sha)
            self._commit(marker)
        except CheckpointFailed:
            raise
        except Exception as e:  # noqa: BLE001 - storage errors of any fsspec backend
            raise CheckpointFailed(f"replicating checkpoint {ck_id} to {self.url} failed: {_short(e)}") from e
        return marker

    def _commit(self, marker: Replica) -> None:
        final = self._marker_path(marker.sandbox, marker.id)
        tmp = f"{self.root}/{marker.sandbox}/.tmp-{marker.id}-{uuid.uuid4().hex[:8]}"
        fields = {"format": FORMAT, **marker.__dict__}
        fields[MAC_FIELD] = self.key.sign(fields)
        self._put(tmp, json.dumps(fields, sort_keys=True).encode())
        self.fs.mv(tmp, final)  # local: rename(2); object stores: one server-side copy
        if self.local:
            fsync_dir(Path(_parent(final)))

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

    # ------------------------------------------------------------------ reading

    def list(self, sandbox: str | None = None) -> list[Replica]:
        """Committed replicas, oldest first (by sandbox, step, creation time); a marker that
        is not one of ours (unsigned, foreign, or under a name not its own) is left out."""
        out = []
        sandboxes = [sandbox] if sandbox else [p.rsplit("/", 1)[-1] for p in self._ls(self.root) if self.fs.isdir(p)]
        for sb in sandboxes:
            for path in self._ls(f"{self.root}/{sb}"):
                if path.endswith(MARKER_SUFFIX):
                    with contextlib.suppress(Exception):  # a marker removed meanwhile, or foreign
                        out.append(self._read_marker(path))
        return sorted(out, key=lambda r: (r.sandbox, r.step, r.created))

    def get(self, checkpoint_id: str) -> Replica:
        sandbox = _sandbox_of(checkpoint_id)
        try:
            return self._read_marker(self._marker_path(sandbox, checkpoint_id))
        except FileNotFoundError as e:
            raise CheckpointNotFound(f"no committed replica {checkpoint_id!r} at {self.url}") from e
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointNotFound(f"replica {checkpoint_id!r} refused: {e}") from e

    def episode(self, checkpoint_id: str) -> dict[str, Any] | None:
        """The episode record stored with a replica (None if it has none), checked against its marker."""
        rep = self.get(checkpoint_id)
        if rep.episode_sha256 is None:
            return None
        raw = self.fs.cat_file(f"{self.root}/{rep.sandbox}/{rep.id}/{EPISODE}")
        if hashlib.sha256(raw).hexdigest() != rep.episode_sha256:
            raise CheckpointNotFound(f"replica {checkpoint_id}: {EPISODE} does not match its marker")
        return json.loads(raw)

    def fetch(self, checkpoint_id: str, store: CheckpointStore) -> Checkpoint:
        """Download a committed replica into ``store`` (verified, then published); return it there."""
        rep = self.get(checkpoint_id)
        with contextlib.suppress(CheckpointNotFound):
            return store.get(rep.id)  # already here (the same node)
        base = f"{self.root}/{rep.sandbox}/{rep.id}"
        staging = store.new_staging(rep.id)
        try:
            raw = self.fs.cat_file(f"{base}/{MANIFEST}")
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
                with self.fs.open(f"{base}/{rel}", "rb") as src, open(dest, "wb") as dst:
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

    # ------------------------------------------------------------------ removing

    def remove(self, checkpoint_id: str, *, background: bool = True) -> None:
        """Uncommit (the marker goes first: readers stop seeing it at once), then delete the data."""
        sandbox = _sandbox_of(checkpoint_id)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._marker_path(sandbox, checkpoint_id))
        data = f"{self.root}/{sandbox}/{checkpoint_id}"
        if background:
            threading.Thread(target=self._rm_quietly, args=(data,), daemon=True,
                             name=f"belayer-replica-rm-{checkpoint_id[-8:]}").start()
        else:
            self._rm_quietly(data)

    def remove_sandbox(self, sandbox: str, *, keep: str | None = None) -> list[str]:
        """Remove every replica of ``sandbox`` except ``keep``; return the ids removed."""
        _check_name(sandbox)
        gone = [r.id for r in self.list(sandbox) if r.id != keep]
        for ck_id in gone:
            self.remove(ck_id, background=False)
        if keep is None:
            self._rm_quietly(f"{self.root}/{sandbox}")
        return gone

    def clean_incomplete(self, older_than_s: float = 3600.0) -> list[str]:
        """Remove uploads that never got a marker (their writer died) once ``older_than_s`` old."""
        removed = []
        now = time.time()
        for sdir in self._ls(self.root):
            if not self.fs.isdir(sdir):
                continue
            entries = self._ls(sdir)
            committed = {p[: -len(MARKER_SUFFIX)] for p in entries if p.endswith(MARKER_SUFFIX)}
            for p in entries:
                if p.endswith(MARKER_SUFFIX) or p in committed:
                    continue
                if now - _mtime(self.fs, p) > older_than_s:
                    self._rm_quietly(p)
                    removed.append(p)
        return removed

    def _rm_quietly(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            self.fs.rm(path, recursive=True)

    # ------------------------------------------------------------------ helpers

    def _ls(self, path: str) -> list[str]:
        try:
            return [p.rstrip("/") for p in self.fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []

    def _marker_path(self, sandbox: str, checkpoint_id: str) -> str:
        return f"{self.root}/{sandbox}/{checkpoint_id}{MARKER_SUFFIX}"

    def _read_marker(self, path: str) -> Replica:
        """A marker this cluster signed, naming plain names, at the place its id and sandbox
        give (``<sandbox>/<id>.ready.json``); ``ValueError`` otherwise."""
        data = json.loads(self.fs.cat_file(path))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a belayer replica marker (format {FORMAT})")
        mac = data.pop(MAC_FIELD, None)
        if not self.key.verify(data, mac):
            raise ValueError(f"{path} is not signed with this cluster's replica key "
                             f"({'no signature' if mac is None else 'wrong signature'}): refused")
        data.pop("format")
        rep = Replica(**data)
        if sandbox_of(rep.id) != check_plain("sandbox name", rep.sandbox):
            raise ValueError(f"{path}: checkpoint {rep.id!r} is not of sandbox {rep.sandbox!r}")
        # the signature covers id and sandbox, and they must name this very file: a marker
        # copied to another name (no key needed) answers for nothing
        if path.rsplit("/", 2)[-2:] != [rep.sandbox, f"{rep.id}{MARKER_SUFFIX}"]:
            raise ValueError(f"{path} is the marker of {rep.id!r} of sandbox {rep.sandbox!r}, copied to another "
                             "name: refused")
        return rep

    def __repr__(self) -> str:
        return f"ReplicaLocation({self.url!r})"


class ReplicatedCheckpointStore(CheckpointStore):
    """A ``CheckpointStore`` whose checkpoints are replicated before they are published.

    ``publish`` uploads the staged checkpoint to ``replica`` and commits it there first, then
    renames it into the local store: a checkpoint is ready only once it would survive the
    node. A failed upload fails the checkpoint (``CheckpointFailed``: nothing published).
    ``remove`` uncommits the replica too, so a checkpoint of an abandoned branch never
    outlives its local copy. ``episode(step)``, if given, returns the JSON record stored with
    the replica (task, setup, committed steps 1..step): what another node needs to resume.
    """

    def __init__(self, path: str | os.PathLike[str] | None, replica: ReplicaLocation | str, *,
                 keep: int | None = 3, scratch: str | os.PathLike[str] | None = None,
                 episode: Callable[[int], dict[str, Any]] | None = None,
                 key_file: str | os.PathLike[str] | None = None, **store_options: Any):
        super().__init__(path, keep=keep, scratch=scratch, **store_options)
        self.replica = replica if isinstance(replica, ReplicaLocation) else ReplicaLocation(replica, key_file=key_file)
        self.episode = episode
        self.uploads: list[tuple[str, int, float]] = []
        """(checkpoint id, bytes, seconds) of every upload, for measurements."""

    def publish(self, staging: Path, sandbox: str, checkpoint_id: str) -> Checkpoint:
        data, _ = read_manifest_digest(staging)
        t0 = time.monotonic()
        self.replica.upload(staging, self.episode(int(data["step"])) if self.episode else None)
        self.uploads.append((checkpoint_id, int(data["size_bytes"]), time.monotonic() - t0))
        try:
            return super().publish(staging, sandbox, checkpoint_id)
        except BaseException:
            self.replica.remove(checkpoint_id)
            raise

    def remove(self, checkpoint_id: str) -> None:
        try:
            self.replica.remove(checkpoint_id)
        finally:
            super().remove(checkpoint_id)

    def __repr__(self) -> str:
        return f"ReplicatedCheckpointStore({str(self.path)!r}, replica={self.replica.url!r}, keep={self.keep})"


def _protocols(fs: Any) -> set[str]:
    p = fs.protocol
    return {p} if isinstance(p, str) else set(p)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0]


def _sandbox_of(checkpoint_id: str) -> str:
    try:
        return sandbox_of(checkpoint_id)
    except ValueError as e:
        raise CheckpointNotFound(f"not a checkpoint id: {e}") from e


def _check_name(name: str) -> None:
    try:
        check_plain("sandbox name", name)
    except ValueError as e:
        raise UsageError(str(e)) from e


def _new_file(staging: Path, rel: str) -> Path:
    """``staging/rel`` created empty, never through a link (``rel``: a checked entry name)."""
    head, _, name = rel.rpartition("/")
    directory = staging / head if head else staging
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.is_symlink():
        raise CheckpointNotFound(f"{directory} is a symlink")
    os.close(os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    return directory / name


def _mtime(fs: Any, path: str) -> float:
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return time.time()
    m = info.get("mtime") or info.get("LastModified") or info.get("updated") or info.get("created")
    if hasattr(m, "timestamp"):
        return m.timestamp()
    try:
        return float(m)
    except (TypeError, ValueError):
        return time.time()  # unknown age (an object store's pseudo-directory): never reaped as old


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1][:400]}" if text else type(e).__name__
