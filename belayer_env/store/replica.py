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
refused, never fetched (``replica_marker``). Names in markers and manifests are checked
(``names``): a fetch (``replica_fetch``) writes only the layer and ``runtime/<plain name>``
under its own staging directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from belayer_core.errors import CheckpointFailed, CheckpointNotFound, UsageError
from belayer_env.store.manifest import Checkpoint, read_manifest_digest
from belayer_env.store.names import check_plain, sandbox_of
from belayer_env.store.replica_auth import ReplicaKey
from belayer_env.store.replica_fetch import download
from belayer_env.store.replica_marker import EPISODE, MARKER_SUFFIX, Replica, believed, marker_path
from belayer_env.store.replica_upload import Writer
from belayer_env.store.store import CheckpointStore


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
        self._writer = Writer(self.fs, self.root, self.key, local=self.local)

    # ------------------------------------------------------------------ writing

    def upload(self, directory: Path, episode: dict[str, Any] | None = None) -> Replica:
        """Copy a fully written checkpoint directory, then commit it with its marker
        (``replica_upload``).

        Every byte read is checked against the manifest on the way (a local copy that went
        bad is not replicated). ``CheckpointFailed`` when anything fails: nothing committed.
        """
        data, manifest_sha = read_manifest_digest(directory)
        _check_name(data["sandbox"])
        try:
            return self._writer.upload(directory, data, manifest_sha, episode)
        except CheckpointFailed:
            raise
        except Exception as e:  # noqa: BLE001 - storage errors of any fsspec backend
            raise CheckpointFailed(f"replicating checkpoint {data['id']} to {self.url} failed: {_short(e)}") from e

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
            return self._read_marker(marker_path(self.root, sandbox, checkpoint_id))
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
        return download(self.fs, f"{self.root}/{rep.sandbox}/{rep.id}", rep, store)

    # ------------------------------------------------------------------ removing

    def remove(self, checkpoint_id: str, *, background: bool = True) -> None:
        """Uncommit (the marker goes first: readers stop seeing it at once), then delete the data."""
        sandbox = _sandbox_of(checkpoint_id)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(marker_path(self.root, sandbox, checkpoint_id))
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

    def _read_marker(self, path: str) -> Replica:
        return believed(self.fs.cat_file(path), path, self.key)

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
