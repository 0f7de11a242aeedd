"""``full_checkpoint``: file-system layer + CRIU runtime from one frozen instant.

Two ways to freeze (``capture``, default ``$BELAYER_CAPTURE`` else ``incremental``):

- ``incremental``: runc's and CRIU's start-up run while the sandbox runs; the cgroup is
  frozen (by us: CRIU's own freeze polls in 100 ms steps) only when CRIU is about to seize
  it; inside the freeze, alongside the memory dump, only the layer entries changed since
  the previous capture (or since the restore the sandbox came from) are copied into tmpfs
  (``delta.py``, against the mirror of ``incremental.py``); the cgroup is thawed as soon as
  CRIU lets go (action scripts, ``criu/hooks.py``). runc, CRIU and the copy run at a raised priority
  (``runtime.CRIU_NICE``). ``frozen_s`` is our freeze to our thaw; the manifest's
  ``frozen_detail`` says where it went.
- ``paused``: Docker pauses the container, CRIU dumps it and tar copies the whole upperdir
  side by side, Docker unpauses it (what Belayer did before; ``frozen_s`` from pause
  returned to unpause returned).

Both frozen parts are ``frozen.py``'s. After thaw the artifacts are copied into a staging
directory of the store with sha256 on the way (``artifacts.py``; the full layer, rebuilt
from the sandbox's mirror in ``incremental`` mode), made durable, described by a manifest,
and published by one rename. Every checkpoint holds a
complete layer: none depends on another. Any failure or a kill at any point leaves
nothing published (staging is removed, or reaped later by
``CheckpointStore.clean_incomplete`` when the writer died).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import docker

from belayer_core.errors import BelayerError, CheckpointFailed, InfraError, UsageError
from belayer_env.capture import incremental
from belayer_env.capture.artifacts import (
    check_free,
    check_space,
    tree_bytes,
    write_artifacts,
    write_layer,
)
from belayer_env.capture.delta import Delta
from belayer_env.capture.frozen import frozen_incremental, frozen_paused
from belayer_env.common.phases import Phase, PhaseHook, no_hook
from belayer_env.criu import precheck, runtime
from belayer_env.sandbox import disk, freezer
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.protocol import Sandbox
from belayer_env.store import layer, merged_layer, shared_layer
from belayer_env.store.manifest import Checkpoint, write_manifest
from belayer_env.store.store import CheckpointStore

CAPTURE_MODES = ("incremental", "paused")


def default_capture() -> str:
    """``$BELAYER_CAPTURE`` (``incremental`` or ``paused``), else ``incremental``."""
    mode = os.environ.get("BELAYER_CAPTURE") or "incremental"
    if mode not in CAPTURE_MODES:
        raise UsageError(f"BELAYER_CAPTURE must be one of {CAPTURE_MODES}, got {mode!r}")
    return mode


def new_id(sandbox: str, step: int) -> str:
    return f"{sandbox}.{step:06d}.{uuid.uuid4().hex[:8]}"


def full_checkpoint(sandbox: Sandbox, store: CheckpointStore, step: int | None = None, *, runtime: bool = True,
                    phase_hook: PhaseHook | None = None, capture: str | None = None,
                    _thawed: threading.Event | None = None, _abort: threading.Event | None = None) -> Checkpoint:
    """Checkpoint ``sandbox`` at action boundary ``step``; block until published.

    Without ``step`` the store numbers it: one past the newest checkpoint of this sandbox
    in ``store`` (1 for the first). ``capture``: ``incremental`` or ``paused`` (see the
    module; default ``default_capture()``). Raises ``CheckpointFailed`` (nothing
    published, older checkpoints intact). The sandbox runs again as soon as the frozen
    part ends, even on failure.
    """
    capture = capture or default_capture()
    if capture not in CAPTURE_MODES:
        raise UsageError(f"capture must be one of {CAPTURE_MODES}, got {capture!r}")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise UsageError(f"step must be an int >= 0 (or None: the store numbers it), got {step!r}")
    ck = _Capture(sandbox, store, runtime, phase_hook or no_hook, capture, _thawed, _abort).run(step)
    with contextlib.suppress(OSError, BelayerError):  # retention is best effort: ck is published
        store.prune(sandbox.name)
    return ck


class _Capture:
    """One capture, step by step (``run``): checks before the freeze, the frozen part, the
    artifacts written after thaw, the manifest, the publication. ``phase`` names the step a
    failure happened in; whatever it leaves unpublished is removed."""

    def __init__(self, sandbox: Sandbox, store: CheckpointStore, with_runtime: bool, hook: PhaseHook, mode: str,
                 thawed: threading.Event | None, abort: threading.Event | None):
        self.sandbox, self.store, self.with_runtime, self.hook, self.mode = sandbox, store, with_runtime, hook, mode
        self.thawed, self.abort = thawed, abort
        self.t0 = time.monotonic()
        self.phase = "start"
        self.ck_id = ""
        self.scratch: Path | None = None  # the frozen part's output (tmpfs by default)
        self.staging: Path | None = None  # the checkpoint being written, in the store
        self.info: dict[str, Any] = {}  # Docker's inspect of the sandbox
        self.upper = Path()
        self.shared: shared_layer.SharedLower | None = None  # a fork's shared lower layer
        self.mirror: incremental.Mirror | None = None
        self.delta: Delta | None = None
        self.extra: dict[str, Any] = {}  # what the manifest records of this capture's way

    def run(self, step: int | None) -> Checkpoint:
        sandbox = self.sandbox
        self.ck_id = f"{sandbox.name} (step {step})"
        try:
            with self.store.lock(sandbox.name):
                step = self._check(step)
                self.phase = "freeze"
                frozen_s = self._frozen()
                self.phase = "thawed"
                if self.thawed is not None:
                    self.thawed.set()
                self.hook(Phase.THAWED)
                self.phase = "write"
                files = self._write()
                self.hook(Phase.WRITTEN)
                self._manifest(step, frozen_s, files)
                self.phase = "publish"
                assert self.staging is not None
                ck = self.store.publish(self.staging, sandbox.name, self.ck_id)
                self.staging = None
                self.hook(Phase.PUBLISHED)
                return ck
        except BaseException as e:
            if self.staging is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
            if isinstance(e, CheckpointFailed) or not isinstance(e, Exception):
                raise
            raise CheckpointFailed(f"checkpoint {self.ck_id} of sandbox {sandbox.name} failed ({self.phase}): "
                                   f"{_why(e)}") from e
        finally:
            if self.thawed is not None:
                self.thawed.set()
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)

    def _check(self, step: int | None) -> int:
        """Before the freeze (under the store's lock of this sandbox): the boundary's number,
        a running sandbox at a boundary that CRIU can dump, and room for what it captures."""
        sandbox, store = self.sandbox, self.store
        if step is None:
            step = store.next_step(sandbox.name)
        self.ck_id = new_id(sandbox.name, step)
        if self.with_runtime and (why := runtime_unavailable(sandbox)):
            raise CheckpointFailed(f"runtime checkpoint unavailable: {why}; pass runtime=False for a file-system-only (degraded) checkpoint")
        self.info = _inspect(sandbox)
        if self.with_runtime and (why := precheck.undumpable(freezer.control_file(sandbox.container_id),
                                                             int(self.info["State"].get("Pid") or 0))):
            raise _refused(why)  # e.g. CRIU would retry for 10 s with the sandbox frozen, then fail
        self.upper = layer.upper_dir(self.info)
        self.shared = shared_layer.of_container(self.info)  # a fork: its upperdir holds only its own writes
        check_space(sandbox, self.info, store)  # before the freeze: a too-large layer never freezes
        self.scratch = store.new_scratch(self.ck_id)
        self.extra = {"capture": self.mode, **({"shared_lower": self.shared.name} if self.shared else {})}
        return step

    def _frozen(self) -> float:
        """The frozen part (``frozen.py``); returns the seconds frozen. Incremental: the
        mirror's base is picked first (everything slow happens before the freeze)."""
        sandbox, store, scratch = self.sandbox, self.store, self.scratch
        assert scratch is not None
        if self.mode != "incremental":
            return frozen_paused(sandbox, self.info, self.upper, scratch, self.with_runtime, self.hook, self.abort,
                                 store.max_layer_bytes)
        self.mirror = incremental.Mirror(store.mirror_dir(sandbox.name))
        base = incremental.prepare(self.mirror, self.upper, getattr(sandbox, "restored_from", None), store,
                                   getattr(sandbox, "layer_installed_ns", None))
        try:
            control = freezer.control_file(sandbox.container_id)
            self.delta = Delta(self.upper, scratch, base, store.max_layer_bytes,
                               control.parent / "cgroup.procs" if control else None)
            frozen_s, self.extra["frozen_detail"] = frozen_incremental(sandbox, self.info, scratch, self.delta,
                                                                      self.with_runtime, self.hook, self.abort)
        except BaseException:
            base.close()
            raise
        self.extra["layer_base"] = base.kind if base.source is None else f"{base.kind}:{base.source}"
        self.extra["layer_entries_copied"] = len(self.delta.changed)
        self.extra["layer_entries"] = len(self.delta.scan)
        self.extra["layer_copied_twice"] = self.delta.retried  # CRIU's temp dir seen: copied again once CRIU was done
        return frozen_s

    def _write(self) -> dict[str, dict[str, Any]]:
        """After thaw: the whole layer (incremental: the mirror brought to the frozen instant,
        then tarred; a fork: its upperdir merged with the shared layer under it) and the
        runtime images into staging, hashed on the way; returns the manifest's ``files``."""
        store, scratch, shared, limit = self.store, self.scratch, self.shared, self.store.max_layer_bytes
        assert scratch is not None
        check_free(store.path, tree_bytes(scratch) + ((disk.usage(self.info) or 0) if self.delta else 0),
                   "the checkpoint store")
        staging = self.staging = store.new_staging(self.ck_id)
        if self.delta is not None and self.mirror is not None:
            tree = self._update_mirror(self.mirror, self.delta)
            if shared is not None:
                files = write_layer(staging, lambda fo: merged_layer.tar_merged(shared, tree, fo, scratch, limit))
            else:
                files = write_layer(staging, lambda fo: incremental.tar_tree(tree, fo, limit))
        elif shared is not None:  # the fork's upperdir + the shared layer under it: the whole layer
            files = write_layer(staging, lambda fo: merged_layer.tar_merged_from_tar(shared, scratch / "layer.tar", fo,
                                                                                     scratch, limit))
        else:
            return write_artifacts(scratch, staging)
        return {**files, **write_artifacts(scratch, staging, with_layer=False)}

    def _update_mirror(self, mirror: incremental.Mirror, delta: Delta) -> Path:
        """The mirror made the upperdir of the frozen instant (dropped if that fails: never
        trusted half-updated); returns its tree."""
        # a fork's mirror is of its upperdir only: never the layer of ck_id (restored-mirror)
        of = self.ck_id if self.shared is None else f"{self.ck_id}+upper"
        try:
            incremental.update(mirror, self.upper, delta, of)
        except BaseException:
            mirror.drop()
            raise
        finally:
            delta.base.close()
        return mirror.tree

    def _manifest(self, step: int, frozen_s: float, files: dict[str, dict[str, Any]]) -> None:
        sandbox, info = self.sandbox, self.info
        assert self.staging is not None
        write_manifest(self.staging, {
            "id": self.ck_id, "sandbox": sandbox.name, "step": step, "created": time.time(),
            "frozen_s": frozen_s, "total_s": time.monotonic() - self.t0,
            "size_bytes": sum(f["size"] for f in files.values()),
            "has_runtime": self.with_runtime, "config": sandbox.config.model_dump(mode="json"),
            "image_id": info["Image"], "source_container": sandbox.container_id, "files": files,
            "network_disabled": bool(info["Config"].get("NetworkDisabled")), **self.extra,
        })


def _refused(why: str) -> CheckpointFailed:
    err = CheckpointFailed(f"runtime checkpoint refused: {why}")
    err.reason = why  # type: ignore[attr-defined]  # the one line the env reports
    return err


def runtime_unavailable(sandbox: Sandbox) -> str | None:
    return runtime.available(sandbox.container_id)


def _inspect(sandbox: Sandbox) -> dict[str, Any]:
    with translate_errors(f"inspect sandbox {sandbox.name}"):
        info = sandbox.client.api.inspect_container(sandbox.container_id)
    if not info["State"].get("Running"):
        raise CheckpointFailed(f"sandbox {sandbox.name} is not running ({info['State'].get('Status')})")
    # A command still running is outside the container's init tree: CRIU would silently
    # leave it out while the layer keeps its partial effects. Boundaries only.
    for exec_id in info.get("ExecIDs") or ():
        try:
            running = sandbox.client.api.exec_inspect(exec_id).get("Running")
        except docker.errors.NotFound:
            continue
        if running:
            raise CheckpointFailed(f"sandbox {sandbox.name} is running a command: checkpoints are taken "
                                   "at action boundaries only")
    return info


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename or ''}".rstrip(": ")
    if isinstance(e, InfraError):
        return f"{type(e).__name__}: {e}"
    return str(e) or type(e).__name__
