"""``full_restore``: a fresh container at a checkpoint's boundary (layer + CRIU runtime).

Order: read the manifest -> claim a copy pre-staged against exactly this manifest
(``prestaging``: unpacked + verified ahead of time) or else, on two threads, unpack the
layer and link/copy the CRIU images onto Docker's disk, checking every byte against the
manifest -> only once every artifact is verified, fence every container of that sandbox
(killed, renamed aside; removed after the restore) and create a container with the same
settings and the exact image the checkpoint was taken on -> rename the verified layer
into its (empty) upperdir and the images into its checkpoint directory -> start from the
checkpoint -> check it runs. Nothing is started from bytes that disagree with the
manifest, and a corrupt or incomplete checkpoint (``RestoreFailed`` naming the artifact)
leaves a live sandbox of that name untouched. A checkpoint without
runtime state, or whose runtime CRIU refuses, is restored file-system-only only when the
caller passes ``allow_degraded=True``; the result then says ``.degraded = True``.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker

from belayer.errors import BelayerError, RestoreFailed
from belayer_env import fence
from belayer_env.checkpoint import layer, prestaging, runtime
from belayer_env.checkpoint.manifest import Checkpoint, read_manifest_digest
from belayer_env.checkpoint.store import owner_tag
from belayer_env.docker_api import connect, translate_errors
from belayer_env.fence import remove, remove_quietly
from belayer_env.phases import Phase, PhaseHook, no_hook
from belayer_env.sandbox import DockerSandbox, create_container

RESTORE_NAME = "belayer"  # Docker's checkpoint name inside the new container's directory
RUNNING_TIMEOUT_S = 30.0


def full_restore(checkpoint: Checkpoint, *, allow_degraded: bool = False, client: docker.DockerClient | None = None,
                 phase_hook: PhaseHook | None = None, name: str | None = None,
                 use_staged: bool = True) -> DockerSandbox:
    """Restore ``checkpoint`` into a fresh container; raise ``RestoreFailed`` naming it.

    ``name``: restore as this sandbox (fenced instead of the checkpoint's own name; what
    ``fork`` and the standby use). ``use_staged=False`` leaves a pre-staged copy for the
    sandbox's own restore.
    """
    hook = phase_hook or no_hook
    ck = checkpoint
    target = name or ck.sandbox
    try:
        data, digest = read_manifest_digest(Path(ck.path))
    except ValueError as e:
        raise RestoreFailed(f"checkpoint {ck.id} is incomplete: {e}", checkpoint=ck.id) from e
    if not ck.has_runtime and not allow_degraded:
        raise RestoreFailed(f"checkpoint {ck.id} holds no runtime state; a file-system-only restore "
                            "needs allow_degraded=True", checkpoint=ck.id)
    client = client or connect(ck.config.docker_host)
    tmp = prestaging.docker_tmp(client)
    prestaging.clean_dead_staging(tmp)
    staged = prestaging.claim(client, ck, digest) if ck.has_runtime and use_staged else None
    if staged is not None:  # pre-staged and verified against this very manifest
        hook(Phase.STAGED)
        fs = _Staged.ready(ck, "file-system layer", staged / "layer")
        images: _Staged | None = _Staged.ready(ck, "runtime images", staged / "images")
    else:
        # unpack + verify both artifacts on Docker's disk, side by side; each is then moved
        # into place with one rename
        fs = _Staged(ck, "file-system layer", tmp, lambda d: layer.install(
            Path(ck.path) / "layer.tar", d, data["files"]["layer.tar"]))
        images = _Staged(ck, "runtime images", tmp, lambda d: runtime.install(
            Path(ck.path), data["files"], d)) if ck.has_runtime else None
    cid, fenced, degraded = None, [], not ck.has_runtime
    try:
        for part in (fs, images):
            if part is not None:
                part.verified()  # before anything touches the sandbox of that name
        fenced = fence.kill(client, target)
        cid = _create(client, ck, data, target)
        hook(Phase.CREATED)
        fs.move_to(_upper(client, cid))
        layer_ns = time.time_ns()  # the whole layer is in place, nothing of the container ran yet
        hook(Phase.LAYER_INSTALLED)
        if images is not None:
            images_dir = Path(prestaging.docker_root(client)) / "containers" / cid / "checkpoints" / RESTORE_NAME
            images.move_to(images_dir)
            # Docker uploads the directory to containerd's content store by digest: two
            # restores of one checkpoint at once (fork) would collide ("already exists")
            (images_dir / "belayer-nonce").write_text(uuid.uuid4().hex)
            hook(Phase.RUNTIME_VERIFIED)
            try:
                runtime.start_from(client, cid, RESTORE_NAME)
            except (docker.errors.APIError, BelayerError) as e:
                remove(client, cid)
                cid = None
                if not allow_degraded:
                    raise RestoreFailed(f"checkpoint {ck.id}: CRIU restore failed: {_short(e)}",
                                        checkpoint=ck.id) from e
                degraded = True
                cid = _create(client, ck, data, target)
                layer.install(Path(ck.path) / "layer.tar", _upper(client, cid), data["files"]["layer.tar"])
                layer_ns = time.time_ns()
        if degraded:
            with translate_errors(f"start restored sandbox {ck.sandbox}"):
                client.api.start(cid)
        hook(Phase.STARTED)
        _wait_running(client, cid, ck)
        hook(Phase.VERIFIED)
    except Exception as e:
        if cid is not None:
            remove_quietly(client, cid)
        if isinstance(e, RestoreFailed):
            raise
        if isinstance(e, layer.LayerError):
            raise RestoreFailed(f"checkpoint {ck.id}: file-system layer unusable: {e}", checkpoint=ck.id) from e
        raise RestoreFailed(f"restore of checkpoint {ck.id} failed: {_short(e)}", checkpoint=ck.id) from e
    finally:
        for part in (fs, images):
            if part is not None:
                part.discard()
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)
        fence.remove_in_background(client, fenced)  # after the restore: no disk contention with it
    sandbox = DockerSandbox.attach(cid, ck.config, target, client)
    sandbox.restored_from = ck.id
    sandbox.layer_installed_ns = layer_ns
    sandbox.degraded = degraded
    return sandbox


class _Staged:
    """Runs ``fill(dir)`` on a thread into a fresh dir under ``tmp``; ``move_to`` renames it.

    ``_Staged.ready(dir)``: content already there and verified (a claimed pre-staged copy).
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
    def ready(cls, ck: Checkpoint, what: str, directory: Path) -> _Staged:
        """Content already unpacked and verified (a claimed pre-staged copy)."""
        self = cls(ck, what, directory.parent, None)
        self.dir = directory
        return self

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
            raise RestoreFailed(f"checkpoint {self.ck.id}: {self.what} unusable: {_short(self.error)}",
                                checkpoint=self.ck.id) from self.error

    def move_to(self, dest: Path) -> None:
        """Put the verified content at ``dest`` (an empty dir there is replaced)."""
        self.verified()
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if dest.is_dir():
            dest.rmdir()
        try:
            os.rename(self.dir, dest)
        except OSError as e:  # a capped sandbox layer is a file system of its own (belayer_env.disk)
            if e.errno != errno.EXDEV:
                raise
            dest.mkdir(mode=0o755)
            layer.copy_tree(self.dir, dest)

    def discard(self) -> None:
        if self._thread is not None:
            self._thread.join()
        shutil.rmtree(self.dir, ignore_errors=True)



def _create(client: docker.DockerClient, ck: Checkpoint, data: dict[str, Any], name: str) -> str:
    """A created (not started) container with the checkpoint's settings and exact image."""
    config = ck.config.model_copy(update={"image": data.get("image_id") or ck.config.image})
    return create_container(client, config, name).id


def _upper(client: docker.DockerClient, cid: str) -> Path:
    with translate_errors("inspect restored sandbox"):
        return layer.upper_dir(client.api.inspect_container(cid))


def _wait_running(client: docker.DockerClient, cid: str, ck: Checkpoint) -> None:
    """Bounded check that the restored container runs (a failed CRIU restore exits it)."""
    deadline = time.monotonic() + RUNNING_TIMEOUT_S
    while True:
        with translate_errors(f"inspect restored sandbox {ck.sandbox}"):
            state = client.api.inspect_container(cid)["State"]
        if state.get("Running"):
            return
        if state.get("Status") in ("exited", "dead") or time.monotonic() > deadline:
            remove(client, cid)
            raise RestoreFailed(f"checkpoint {ck.id}: restored container is not running "
                                f"({state.get('Status')}: {state.get('Error') or state.get('ExitCode')})",
                                checkpoint=ck.id)
        time.sleep(0.02)



def _short(e: BaseException) -> str:
    text = str(getattr(e, "explanation", "") or e).strip().splitlines()
    return text[-1][:600] if text else type(e).__name__
