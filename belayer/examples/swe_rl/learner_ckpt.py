"""Learner fault tolerance: asynchronous, atomically published checkpoints.

At a step boundary the learner takes an in-memory snapshot (parameters + optimizer state,
cloned: milliseconds for the embedded model) and goes on with the next rollout while a
background thread writes it. A checkpoint becomes visible only when complete: payload
written and fsynced in a temporary directory, manifest with the payload's SHA-256
written and fsynced, then one ``rename`` to ``step-NNNNNNNN`` and an fsync of the parent.
A learner killed mid-save leaves a ``.tmp-*`` directory that ``latest_complete`` never
returns (and ``clean_incomplete`` removes); resume takes the newest verified one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

from belayer_core.errors import CheckpointFailed

PAYLOAD, MANIFEST, PREFIX, TMP_PREFIX = "state.pt", "manifest.json", "step-", ".tmp-"
PhaseHook = Callable[[str, int], None]


class LearnerCheckpointConfig(BaseModel):
    directory: str
    keep: int = Field(default=3, ge=1)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **extra: Any) -> dict:
    """A detached copy of everything needed to resume (safe to write from another thread)."""
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict()), "extra": copy.deepcopy(extra)}


class LearnerCheckpointer:
    """At most one save in flight; ``save_async`` first waits for the previous one."""

    def __init__(self, config: LearnerCheckpointConfig, phase_hook: PhaseHook | None = None):
        self.config = config
        self.dir = Path(config.directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.phase_hook = phase_hook
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_published: Path | None = None
        self.save_seconds: list[float] = []

    def save_async(self, step: int, state: dict) -> None:
        """Publish ``state`` (from :func:`snapshot`) as step ``step`` in the background."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(step, state), name=f"ckpt-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the save in flight is published; raise ``CheckpointFailed`` if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointFailed(f"learner checkpoint failed: {err}") from err
        return self.last_published

    def _phase(self, name: str, step: int) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name, step)

    def _run(self, step: int, state: dict) -> None:
        try:
            self.last_published = self._write(step, state)
        except BaseException as exc:  # reported by wait(); never half-published
            self._error = exc

    def _write(self, step: int, state: dict) -> Path:
        t0 = time.monotonic()
        tmp = self.dir / f"{TMP_PREFIX}{PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(mode=0o700)
        payload = tmp / PAYLOAD
        with open(payload, "wb") as f:
            torch.save({"step": step, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        self._phase("payload_written", step)
        manifest = {"format": 1, "step": step, "payload": PAYLOAD, "sha256": _sha256(payload),
                    "bytes": payload.stat().st_size, "created": time.time()}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        self._phase("manifest_written", step)
        final = self.dir / f"{PREFIX}{step:08d}"
        if final.exists():  # a re-run of the same step after a resume: replace atomically
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        self._phase("published", step)
        self.prune()
        self.save_seconds.append(time.monotonic() - t0)
        return final

    def prune(self) -> None:
        for old in complete_checkpoints(self.dir)[self.config.keep:]:
            shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """Published checkpoints, newest first (by step); temporary directories never count."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def verify(path: Path) -> dict | None:
    """The manifest when the payload matches its checksum, else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        payload = path / manifest["payload"]
        if payload.stat().st_size != manifest["bytes"] or _sha256(payload) != manifest["sha256"]:
            return None
        return manifest
    except (OSError, ValueError, KeyError):
        return None


def latest_complete(directory: str | Path) -> Path | None:
    """The newest checkpoint that is published *and* verifies; corrupt ones are skipped."""
    for path in complete_checkpoints(directory):
        if verify(path) is not None:
            return path
    return None


def load(path: Path) -> dict:
    """``{"step", "model", "optimizer", "extra"}`` of a verified checkpoint."""
    if verify(path) is None:
        raise CheckpointFailed(f"learner checkpoint {path} does not verify")
    return torch.load(path / PAYLOAD, map_location="cpu", weights_only=False)


def clean_incomplete(directory: str | Path) -> list[str]:
    """Remove interrupted saves (``.tmp-*``); return their names."""
    d = Path(directory)
    removed = []
    if d.is_dir():
        for p in d.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    return removed
