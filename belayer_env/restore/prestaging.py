"""Pre-staging: unpack + verify a published checkpoint on Docker's disk ahead of a restore.

Re-creating a layer's files on Docker's ext4 costs ~0.6 ms per file (a 2,000-file repo:
1.2-1.9 s), so ``prestage(ck)`` does it off the critical path, right after publish (on the
``PendingCheckpoint``'s thread, while the LLM thinks). ``full_restore`` then claims the
staged copy with one rename and installs layer and images with one rename each.

Layout, in Docker's tmp dir (same file system as the container upperdirs)::

  belayer-restore-prestage-<uuid>~<pid>-<start>   being filled (never read by a restore)
  belayer-restore-staged-<ckid>~<pid>-<start>     complete: layer/ or layer.img, images/, staged.json

A sandbox with a disk cap (``SandboxConfig.disk``) has its writable layer on a file
system of its own (``belayer_env.sandbox.disk``), so a staged ``layer/`` would still be copied
file by file into it at restore (seconds for a repo of a few thousand files). For such a
sandbox the layer is staged as ``layer.img``: that file system, made with the layer
already in it (``disk.prepare_layer_image``); the restore mounts it.

``staged.json`` (written last, before the rename that completes the copy) records the
checkpoint id and the sha256 of the manifest the copy was verified against; a restore
uses the copy only if both match the checkpoint it restores. Only the newest (by
creation time) staged copy per sandbox is kept. Both names carry the writer's pid + start
time, so ``_clean_dead_staging`` removes what a dead process left. A restore claims a
copy by renaming it to a private name (atomic: two restores never share it, and a copy
being removed is never half used); a claimed copy is consumed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import docker

from belayer_core.errors import InfraError
from belayer_core.procfs import mounts
from belayer_env.common.background import Background
from belayer_env.common.phases import Phase, PhaseHook, no_hook
from belayer_env.criu import runtime
from belayer_env.sandbox import disk, writeback
from belayer_env.sandbox.docker_api import connect, translate_errors
from belayer_env.store import in_memory, layer
from belayer_env.store.manifest import Checkpoint, read_manifest_digest
from belayer_env.store.store import owner_alive, owner_tag

PREFIX = "belayer-restore-"  # what _clean_dead_staging reaps when the owner is gone
FILLING, STAGED = PREFIX + "prestage-", PREFIX + "staged-"
RECORD = "staged.json"
LAYER_IMAGE = "layer.img"
INFLIGHT_WAIT_S = 60.0

_inflight: dict[str, threading.Event] = {}  # checkpoint id -> set when its prestage ends
_inflight_lock = threading.Lock()
_ROOTS: dict[int, str] = {}


def docker_root(client: docker.DockerClient) -> str:
    key = id(client)
    if key not in _ROOTS:
        with translate_errors("docker info"):
            _ROOTS[key] = client.info()["DockerRootDir"]
    return _ROOTS[key]


def docker_tmp(client: docker.DockerClient) -> Path:
    return Path(docker_root(client)) / "tmp"


def prestage(checkpoint: Checkpoint, client: docker.DockerClient | None = None, *, phase_hook: PhaseHook | None = None,
             _started: Callable[[], None] | None = None) -> Path | None:
    """Unpack + verify ``checkpoint`` into a staging dir on Docker's disk; return it.

    Returns None (nothing staged) if the checkpoint is unusable (missing, corrupt: the
    restore will say why) or has no runtime state. Removes the sandbox's older staged
    copies. Safe to kill at any point: only a complete, verified copy gets the name a
    restore looks for. Phases: ``layer_unpacked``, ``images_verified``, ``staged``.
    """
    ck = checkpoint
    if not ck.has_runtime:
        return None
    hook = phase_hook or no_hook
    done = _begin(ck.id)
    try:
        if _started is not None:
            _started()
        client = client or connect(ck.config.docker_host)
        tmp = docker_tmp(client)
        clean_dead_staging(tmp)
        if existing := _find(tmp, ck.id):
            return existing
        try:
            data, digest = read_manifest_digest(Path(ck.path))
        except ValueError:
            return None
        work = tmp / f"{FILLING}{uuid.uuid4().hex[:12]}~{owner_tag()}"
        work.mkdir(mode=0o700, parents=True)
        images = Background(runtime.install, Path(ck.path), data["files"], work / "images", link=False,
                            name="belayer-prestage-images")  # own bytes
        try:
            size = ck.config.disk_bytes
            fsroot = work / "fsroot" if size is not None else work
            fsroot.mkdir(mode=0o700, exist_ok=True)
            on_tmpfs = size is not None and _in_memory(fsroot, Path(ck.path) / "layer.tar")
            (fsroot / "layer").mkdir(mode=0o700)
            layer.install(Path(ck.path) / "layer.tar", fsroot / "layer", data["files"]["layer.tar"])
            if size is not None:  # the file system a restore mounts as the new container's layer
                (fsroot / "layer").chmod(0o755)
                (fsroot / "layer").rename(fsroot / "diff")
                (fsroot / "work").mkdir(mode=0o700)
                disk.prepare_layer_image(fsroot, work / LAYER_IMAGE, size)
                if on_tmpfs:
                    in_memory.umount(fsroot)  # the tree's memory goes at once
                    fsroot.rmdir()
                else:
                    _remove_aside(fsroot, tmp)  # thousands of files: seconds under load, not waited for
            hook(Phase.LAYER_UNPACKED)
            images.result()  # verified alongside the layer
            hook(Phase.IMAGES_VERIFIED)
            (work / RECORD).write_text(json.dumps({"id": ck.id, "sandbox": ck.sandbox, "created": ck.created,
                                                   "path": str(ck.path), "manifest_sha256": digest,
                                                   "staged_at": time.time()}))
            final = tmp / f"{STAGED}{ck.id}~{owner_tag()}"
            work.rename(final)
        except (OSError, layer.LayerError, runtime.CriuError, InfraError):
            return None
        finally:
            images.join()
            with contextlib.suppress(OSError):
                in_memory.umount(work / "fsroot")  # a failure left the unpacked tree mounted
            shutil.rmtree(work, ignore_errors=True)  # gone already when renamed
        hook(Phase.STAGED)
        _drop_older(tmp, ck.sandbox)
        writeback.flush_later(tmp)  # not left for the restore's fsyncs to wait for (``writeback``)
        return final if final.exists() else None
    finally:
        done.set()
        with _inflight_lock:
            if _inflight.get(ck.id) is done:
                del _inflight[ck.id]


def claim(client: docker.DockerClient, ck: Checkpoint, manifest_sha256: str) -> Path | None:
    """Take the staged copy of ``ck`` for one restore (renamed to a private dir), or None.

    Waits for a prestage of ``ck`` still running in this process (it is further along
    than a restore starting from scratch). The copy is used only when it was verified
    against exactly this manifest; any other copy found for ``ck`` is discarded.
    """
    with _inflight_lock:
        running = _inflight.get(ck.id)
    if running is not None:
        running.wait(INFLIGHT_WAIT_S)  # bounded: past it, a restore unpacks by itself
    tmp = docker_tmp(client)
    found = _find(tmp, ck.id)
    if found is None:
        return None
    mine = tmp / f"{PREFIX}{uuid.uuid4().hex[:12]}~{owner_tag()}"
    try:
        found.rename(mine)
    except OSError:
        return None  # taken by another restore, or removed as stale, meanwhile
    try:
        record = json.loads((mine / RECORD).read_text())
        images_ok = (mine / "images").is_dir() or not ck.has_runtime
        if (record.get("id") == ck.id and record.get("manifest_sha256") == manifest_sha256
                and ((mine / "layer").is_dir() or (mine / LAYER_IMAGE).is_file()) and images_ok):
            return mine
    except (OSError, ValueError):
        pass
    shutil.rmtree(mine, ignore_errors=True)
    return None


def staged_copies(client: docker.DockerClient, sandbox: str | None = None) -> list[Path]:
    """Complete staged copies (of ``sandbox`` if given) in Docker's tmp dir."""
    return _copies(docker_tmp(client), sandbox)


def discard_copies(client: docker.DockerClient, ck_id: str) -> list[Path]:
    """Remove this process's staged copies of checkpoint ``ck_id`` (it is going away)."""
    tmp = docker_tmp(client)
    gone = []
    with contextlib.suppress(OSError):
        for d in tmp.glob(f"{STAGED}{ck_id}~{owner_tag()}"):
            trash = tmp / f"{PREFIX}{uuid.uuid4().hex[:12]}~{owner_tag()}"
            try:
                d.rename(trash)  # out of a restore's sight first: never half removed
            except OSError:
                continue  # claimed by a restore meanwhile: it consumes the copy
            shutil.rmtree(trash, ignore_errors=True)
            gone.append(d)
    return gone


def _in_memory(fsroot: Path, tar: Path) -> bool:
    """Put the transient unpacked tree of a capped sandbox's layer (it only feeds
    ``mkfs.ext4 -d``) on a tmpfs of its own where it fits (``in_memory.memory_cap``):
    creating thousands of files on Docker's ext4 cost 0.4-3 s of kernel time on the dev VM
    (0.45 ms an ``openat``), into tmpfs 0.1 s; unmounting frees it at once. False: disk."""
    cap = in_memory.memory_cap(tar.stat().st_size)
    return cap is not None and in_memory.try_mount_tmpfs(fsroot, cap, source=in_memory.PRESTAGE, mode="0700")


def _remove_aside(path: Path, tmp: Path) -> None:
    """Rename ``path`` out of the copy being staged (same file system: instant) and delete it on
    a thread; named like any staging dir of this process, so a dying process leaves it to
    ``clean_dead_staging``."""
    trash = tmp / f"{PREFIX}spent-{uuid.uuid4().hex[:12]}~{owner_tag()}"
    path.rename(trash)
    threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True,
                     name="belayer-prestage-clean").start()


def clean_dead_staging(tmp: Path) -> None:
    """Remove what restores and prestages killed mid-way (or their staged copies) left."""
    with contextlib.suppress(OSError):
        for d in tmp.glob(f"{PREFIX}*"):
            if not owner_alive(d.name):
                _umount_under(d)  # in-memory copies: a fork's images, a prestage's or restore's unpack
                shutil.rmtree(d, ignore_errors=True)


def _umount_under(d: Path) -> None:
    """Unmount every mount at or below ``d``, deepest first (``in_memory.umount``: lazily if
    busy; else ``rmtree`` empties a tmpfs but leaves it mounted, its directory impossible to
    remove)."""
    prefix = str(d)
    points = {m.target for m in mounts() if m.target == prefix or m.target.startswith(prefix + "/")}
    with contextlib.suppress(OSError):  # as before the shared reader: a failed umount is not fatal here
        for point in sorted(points, key=len, reverse=True):
            in_memory.umount(Path(point))


def _begin(ck_id: str) -> threading.Event:
    done = threading.Event()
    with _inflight_lock:
        _inflight[ck_id] = done
    return done


def _find(tmp: Path, ck_id: str) -> Path | None:
    with contextlib.suppress(OSError):
        for d in tmp.glob(f"{STAGED}*"):
            if d.name[len(STAGED):].rpartition("~")[0] == ck_id and owner_alive(d.name):
                return d
    return None


def _sandbox_of(d: Path) -> str:
    return d.name[len(STAGED):].rpartition("~")[0].rsplit(".", 2)[0]


def _drop_older(tmp: Path, sandbox: str) -> None:
    """Keep only the most recently created staged copy of ``sandbox``; drop any copy
    (of any sandbox) whose checkpoint is no longer in its store."""
    copies, drop = [], []
    for d in _copies(tmp, None):
        try:
            rec = json.loads((d / RECORD).read_text())
            if not Path(rec["path"]).is_dir():
                drop.append(d)
            elif _sandbox_of(d) == sandbox:
                copies.append(((float(rec["created"]), rec["id"]), d))
        except (OSError, ValueError, KeyError, TypeError):
            drop.append(d)
    copies.sort(key=lambda c: c[0])
    for d in drop + [d for _, d in copies[:-1]]:
        trash = tmp / f"{PREFIX}{uuid.uuid4().hex[:12]}~{owner_tag()}"
        try:
            d.rename(trash)  # out of a restore's sight first: never half removed
        except OSError:
            continue  # claimed by a restore, or removed by another prestage
        shutil.rmtree(trash, ignore_errors=True)


def _copies(tmp: Path, sandbox: str | None) -> list[Path]:
    with contextlib.suppress(OSError):
        return sorted(d for d in tmp.glob(f"{STAGED}*") if sandbox is None or _sandbox_of(d) == sandbox)
    return []
