"""``full_checkpoint``: file-system layer + CRIU runtime from one frozen instant.

Two ways to freeze (``capture``, default ``$BELAYER_CAPTURE`` else ``incremental``):

- ``incremental``: runc's and CRIU's start-up run while the sandbox runs; the cgroup is
  frozen (by us: CRIU's own freeze polls in 100 ms steps) only when CRIU is about to seize
  it; inside the freeze, alongside the memory dump, only the layer entries changed since
  the previous capture (or since the restore the sandbox came from) are copied into tmpfs
  (``incremental``); the cgroup is thawed as soon as CRIU lets go (action scripts,
  ``criu_hooks``). runc, CRIU and the copy run at a raised priority
  (``runtime.CRIU_NICE``). ``frozen_s`` is our freeze to our thaw; the manifest's
  ``frozen_detail`` says where it went.
- ``paused``: Docker pauses the container, CRIU dumps it and tar copies the whole upperdir
  side by side, Docker unpauses it (what Belayer did before; ``frozen_s`` from pause
  returned to unpause returned).

After thaw the artifacts are copied into a staging directory of the store with sha256 on
the way (the full layer, rebuilt from the sandbox's mirror in ``incremental`` mode), made
durable, described by a manifest, and published by one rename. Every checkpoint holds a
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
from belayer_env.criu import precheck, runtime
from belayer_env.criu.hooks import dump_stats
from belayer_env.phases import Phase, PhaseHook, no_hook
from belayer_env.sandbox import disk, freezer, writeback
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.protocol import Sandbox
from belayer_env.store import layer, merged_layer, shared_layer
from belayer_env.store.manifest import Checkpoint, copy_hashed, write_manifest
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
    hook = phase_hook or no_hook
    capture = capture or default_capture()
    if capture not in CAPTURE_MODES:
        raise UsageError(f"capture must be one of {CAPTURE_MODES}, got {capture!r}")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise UsageError(f"step must be an int >= 0 (or None: the store numbers it), got {step!r}")
    t0 = time.monotonic()
    phase = "start"
    scratch = staging = None
    ck_id = f"{sandbox.name} (step {step})"
    try:
        with store.lock(sandbox.name):
            if step is None:
                step = store.next_step(sandbox.name)
            ck_id = new_id(sandbox.name, step)
            if runtime and (why := runtime_unavailable(sandbox)):
                raise CheckpointFailed(f"runtime checkpoint unavailable: {why}; pass runtime=False for a file-system-only (degraded) checkpoint")
            info = _inspect(sandbox)
            if runtime and (why := precheck.undumpable(freezer.control_file(sandbox.container_id),
                                                      int(info["State"].get("Pid") or 0))):
                raise _refused(why)  # e.g. CRIU would retry for 10 s with the sandbox frozen, then fail
            upper = layer.upper_dir(info)
            shared = shared_layer.of_container(info)  # a fork: its upperdir holds only its own writes
            _check_space(sandbox, info, store)  # before the freeze: a too-large layer never freezes
            scratch = store.new_scratch(ck_id)
            mirror = delta = None
            extra: dict[str, Any] = {"capture": capture, **({"shared_lower": shared.name} if shared else {})}
            phase = "freeze"
            if capture == "incremental":
                mirror = incremental.Mirror(store.mirror_dir(sandbox.name))
                base = incremental.prepare(mirror, upper, getattr(sandbox, "restored_from", None), store,
                                           getattr(sandbox, "layer_installed_ns", None))
                try:
                    control = freezer.control_file(sandbox.container_id)
                    delta = incremental.Delta(upper, scratch, base, store.max_layer_bytes,
                                              control.parent / "cgroup.procs" if control else None)
                    frozen_s, extra["frozen_detail"] = _frozen_incremental(sandbox, info, scratch, delta, runtime,
                                                                          hook, _abort)
                except BaseException:
                    base.close()
                    raise
                extra["layer_base"] = base.kind if base.source is None else f"{base.kind}:{base.source}"
                extra["layer_entries_copied"] = len(delta.changed)
                extra["layer_entries"] = len(delta.scan)
                extra["layer_copied_twice"] = delta.retried  # CRIU's temp dir seen: copied again once CRIU was done
            else:
                frozen_s = _frozen_part(sandbox, info, upper, scratch, runtime, hook, _abort, store.max_layer_bytes)
            phase = "thawed"
            if _thawed is not None:
                _thawed.set()
            hook(Phase.THAWED)
            phase = "write"
            _check_free(store.path, _tree_bytes(scratch) + ((disk.usage(info) or 0) if delta else 0),
                        "the checkpoint store")
            staging = store.new_staging(ck_id)
            if delta is not None and mirror is not None:
                try:
                    # a fork's mirror is of its upperdir only: never the layer of ck_id (restored-mirror)
                    incremental.update(mirror, upper, delta, ck_id if shared is None else f"{ck_id}+upper")
                except BaseException:
                    mirror.drop()  # never trusted again half-updated
                    raise
                finally:
                    delta.base.close()
                with open(staging / "layer.tar", "wb") as fo:
                    lsize, ldigest = (merged_layer.tar_merged(shared, mirror.tree, fo, scratch, store.max_layer_bytes)
                                      if shared else incremental.tar_tree(mirror.tree, fo, store.max_layer_bytes))
                files = {"layer.tar": {"size": lsize, "sha256": ldigest}, **_write_artifacts(scratch, staging, False)}
            elif shared is not None:  # the fork's upperdir + the shared layer under it: the whole layer
                with open(staging / "layer.tar", "wb") as fo:
                    lsize, ldigest = merged_layer.tar_merged_from_tar(shared, scratch / "layer.tar", fo, scratch,
                                                                      store.max_layer_bytes)
                files = {"layer.tar": {"size": lsize, "sha256": ldigest}, **_write_artifacts(scratch, staging, False)}
            else:
                files = _write_artifacts(scratch, staging)
            hook(Phase.WRITTEN)
            size = sum(f["size"] for f in files.values())
            write_manifest(staging, {
                "id": ck_id, "sandbox": sandbox.name, "step": step, "created": time.time(),
                "frozen_s": frozen_s, "total_s": time.monotonic() - t0, "size_bytes": size,
                "has_runtime": runtime, "config": sandbox.config.model_dump(mode="json"),
                "image_id": info["Image"], "source_container": sandbox.container_id, "files": files,
                "network_disabled": bool(info["Config"].get("NetworkDisabled")), **extra,
            })
            phase = "publish"
            ck = store.publish(staging, sandbox.name, ck_id)
            staging = None
            hook(Phase.PUBLISHED)
    except BaseException as e:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, CheckpointFailed) or not isinstance(e, Exception):
            raise
        raise CheckpointFailed(f"checkpoint {ck_id} of sandbox {sandbox.name} failed ({phase}): {_why(e)}") from e
    finally:
        if _thawed is not None:
            _thawed.set()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    with contextlib.suppress(OSError, BelayerError):  # retention is best effort: ck is published
        store.prune(sandbox.name)
    return ck


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


def _frozen_part(sandbox: Sandbox, info: dict[str, Any], upper: Path, scratch: Path, with_runtime: bool,
                 hook: PhaseHook, abort: threading.Event | None = None, max_layer: int | None = None) -> float:
    """Pause, dump + tar the layer side by side, unpause; return the seconds spent frozen."""
    api, cid = sandbox.client.api, sandbox.container_id
    with translate_errors(f"pause sandbox {sandbox.name}"):
        if not info["State"].get("Paused"):  # paused already: a checkpointer died mid-freeze
            api.pause(cid)
    t = time.monotonic()
    tar = None
    try:
        hook(Phase.FROZEN)
        tar = layer.Capture(upper, scratch / "layer.tar", max_layer)
        if with_runtime:
            runtime.dump(cid, scratch / "runtime", scratch / "work", isolated=not sandbox.config.network,
                         abort=abort, boosted=False, ghost_limit=sandbox.config.memory_bytes)
            hook(Phase.RUNTIME_DUMPED)
        try:
            tar.wait()
        except layer.LayerChanged:
            # CRIU's dump mkdtemp()s under the container's /tmp (copy-up, then rmdir): a
            # tar racing it sees the tree move. The dump is over now: tar again, still frozen.
            tar = layer.Capture(upper, scratch / "layer.tar", max_layer)
            tar.wait()
        hook(Phase.LAYER_CAPTURED)
    finally:
        if tar is not None:
            tar.abort()
        if with_runtime and not freezer.is_frozen(cid):
            # a CRIU killed after seizing left the cgroup thawed (it re-freezes only at its
            # end) while Docker still holds it paused: freeze it so that the unpause works
            freezer.freeze(cid)
        with translate_errors(f"unpause sandbox {sandbox.name}"):
            api.unpause(cid)
    return time.monotonic() - t


FREEZE_POLL_S = 0.0005
"""How often the freezer state is polled while freezing and while waiting for CRIU to let go."""


class _InFreeze:
    """The freeze hooks of an incremental capture: freeze the cgroup when CRIU is about to
    (fast), start the layer delta once frozen, wait for it (and call the phase hooks)
    before the processes resume, and thaw as soon as CRIU has let them go (it re-freezes
    the cgroup it found frozen). ``paused``: Docker holds the container paused; leave the
    freezer to Docker."""

    def __init__(self, cid: str, init_pid: int, delta: incremental.Delta, hook: PhaseHook, with_runtime: bool,
                 paused: bool):
        self.cid, self.init_pid, self.paused = cid, init_pid, paused
        self.delta, self.hook, self.with_runtime = delta, hook, with_runtime
        self.t_freeze: float | None = None
        self.t_thawed: float | None = None

    def freeze(self) -> None:
        self.t_freeze = time.monotonic()
        if not self.paused and not freezer.freeze(self.cid, poll_s=FREEZE_POLL_S):
            raise CheckpointFailed(f"the freezer cgroup of {self.cid[:12]} did not freeze")

    def frozen(self) -> None:
        if self.t_freeze is None:
            self.t_freeze = time.monotonic()
        self.hook(Phase.FROZEN)
        self.delta.start()

    def before_resume(self) -> None:
        if self.with_runtime:
            self.hook(Phase.RUNTIME_DUMPED)
        self.delta.wait()
        self.hook(Phase.LAYER_CAPTURED)

    def resuming(self) -> None:
        if self.paused:
            return
        deadline = time.monotonic() + freezer.THAW_WAIT_S
        while _tracer(self.init_pid) not in (0, None) and time.monotonic() < deadline:
            time.sleep(FREEZE_POLL_S)  # CRIU re-freezes the cgroup, then detaches: thaw after that
        self.thaw()

    def thaw(self) -> None:
        if not self.paused and self.t_thawed is None and freezer.is_frozen(self.cid):
            freezer.thaw(self.cid)
            self.t_thawed = time.monotonic()


def _tracer(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _frozen_incremental(sandbox: Sandbox, info: dict[str, Any], scratch: Path, delta: incremental.Delta,
                        with_runtime: bool, hook: PhaseHook,
                        abort: threading.Event | None) -> tuple[float, dict[str, float]]:
    """CRIU dumps the container frozen by us right before CRIU's own freeze; the layer
    delta is copied inside that window; thawed as soon as CRIU lets go. Without runtime:
    Docker's pause around the delta copy. Returns the seconds frozen and where they went."""
    api, cid = sandbox.client.api, sandbox.container_id
    paused = bool(info["State"].get("Paused"))  # a checkpointer died mid-freeze (paused mode)
    hooks = _InFreeze(cid, int(info["State"].get("Pid") or 0), delta, hook, with_runtime, paused)
    if not with_runtime:
        with translate_errors(f"pause sandbox {sandbox.name}"):
            if not paused:
                api.pause(cid)
        t = time.monotonic()
        try:
            hooks.frozen()
            hooks.before_resume()
        finally:
            with translate_errors(f"unpause sandbox {sandbox.name}"):
                api.unpause(cid)
        return time.monotonic() - t, {}
    t = time.monotonic()
    try:
        control = freezer.control_file(cid)
        thaw_with = (control, "THAWED" if control.name == "freezer.state" else "0") if control and not paused else None
        runtime.dump(cid, scratch / "runtime", scratch / "work", isolated=not sandbox.config.network,
                     abort=abort, hooks=hooks, orphan_thaw=thaw_with, ghost_limit=sandbox.config.memory_bytes)
    finally:
        if paused:  # CRIU found it frozen and left it so
            if not freezer.is_frozen(cid):
                freezer.freeze(cid)
            with translate_errors(f"unpause sandbox {sandbox.name}"):
                api.unpause(cid)
        else:  # no network-unlock script ran (no network namespace), or the dump failed
            hooks.thaw()
    end = time.monotonic()
    st = dump_stats(scratch / "work")
    detail = {"runc_s": end - t, "before_freeze_s": (hooks.t_freeze or end) - t,
              "delta_scan_entries": len(delta.scan), "delta_copied": len(delta.changed),
              "criu_frozen_s": st.get("frozen_time", 0) / 1e6, "criu_freezing_s": st.get("freezing_time", 0) / 1e6,
              "criu_memdump_s": st.get("memdump_time", 0) / 1e6, "criu_pages_written": st.get("pages_written", 0)}
    if paused or hooks.t_freeze is None:
        return (st.get("freezing_time", 0) + st.get("frozen_time", 0)) / 1e6 or end - t, detail
    return (hooks.t_thawed or end) - hooks.t_freeze, detail


def _check_space(sandbox: Any, info: dict[str, Any], store: CheckpointStore) -> None:
    """Refuse a capture whose layer is over the store's limit, or that the scratch space (RAM,
    by default) cannot hold: the layer plus process memory up to the sandbox's memory limit."""
    used = disk.usage(info)
    if used is not None and used > store.max_layer_bytes:
        raise CheckpointFailed(f"checkpoint of sandbox {sandbox.name} refused: its writable layer holds {used} bytes, "
                               f"over the checkpoint limit of {store.max_layer_bytes} bytes "
                               "(CheckpointStore.max_layer_bytes, $BELAYER_MAX_LAYER_BYTES)")
    layer_bound = store.max_layer_bytes if used is None else used
    _check_free(store.scratch_root, layer_bound + sandbox.config.memory_bytes, "the capture scratch space")


def _check_free(path: Path, need: int, what: str) -> None:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise CheckpointFailed(f"not enough space in {what} ({path}): {free} bytes free, the capture needs up to {need}")


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _write_artifacts(scratch: Path, staging: Path, with_layer: bool = True) -> dict[str, dict[str, Any]]:
    """Copy layer.tar (``with_layer``) and runtime/* into ``staging`` hashing on the way;
    make them (and anything already in ``staging``) durable."""
    files: dict[str, dict[str, Any]] = {}
    sources = [scratch / "layer.tar"] if with_layer else []
    if (scratch / "runtime").is_dir():
        (staging / "runtime").mkdir(mode=0o700)
        sources += sorted((scratch / "runtime").iterdir())
    for src in sources:
        rel = str(src.relative_to(scratch))
        with open(src, "rb") as fi, open(staging / rel, "wb") as fo:
            size, digest = copy_hashed(fi, fo)
        files[rel] = {"size": size, "sha256": digest}
    writeback.syncfs(staging)  # the store's file system in one call, not one fsync per image
    return files


def _why(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename or ''}".rstrip(": ")
    if isinstance(e, InfraError):
        return f"{type(e).__name__}: {e}"
    return str(e) or type(e).__name__
