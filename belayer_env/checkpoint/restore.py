"""``full_restore``: a fresh container at a checkpoint's boundary (layer + CRIU runtime).

Order: read the manifest -> claim a copy pre-staged against exactly this manifest
(``prestaging``: unpacked + verified ahead of time) or else, on two threads, unpack the
layer and link/copy the CRIU images onto Docker's disk, checking every byte against the
manifest -> meanwhile fence every container of that sandbox (killed, renamed aside;
removed after the restore) and create a container with the same settings and the exact
image the checkpoint was taken on -> rename the verified layer into its (empty) upperdir
and the images into its checkpoint directory -> start from the checkpoint -> check it runs.
Nothing is started from bytes that disagree with the manifest. A checkpoint without
runtime state, or whose runtime CRIU refuses, is restored file-system-only only when the
caller passes ``allow_degraded=True``; the result then says ``.degraded = True``.
"""

from __future__ import annotations

import contextlib
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
from belayer_env.checkpoint import layer, prestaging, runtime
from belayer_env.checkpoint.manifest import Checkpoint, read_manifest_digest
from belayer_env.checkpoint.store import owner_tag
from belayer_env.docker_api import connect, translate_errors
from belayer_env.ownership import SANDBOX_NAME
from belayer_env.sandbox import DockerSandbox, create_container

RESTORE_NAME = "belayer"  # Docker's checkpoint name inside the new container's directory
RUNNING_TIMEOUT_S = 30.0


def full_restore(checkpoint: Checkpoint, *, allow_degraded: bool = False, client: Any = None,
                 phase_hook: Callable[[str], None] | None = None) -> DockerSandbox:
    """Restore ``checkpoint`` into a fresh container; raise ``RestoreFailed`` naming it."""
    hook = phase_hook or (lambda _p: None)
    ck = checkpoint
    try:
        data, digest = read_manifest_digest(Path(ck.path))
    except ValueError as e:
        raise RestoreFailed(f"checkpoint {ck.id} is incomplete: {e}", checkpoint=ck.id) from e
    if not ck.has_runtime and not allow_degraded:
        raise RestoreFailed(f"checkpoint {ck.id} holds no runtime state; a file-system-only restore "
                            "needs allow_degraded=True", checkpoint=ck.id)
    client = client or connect(ck.config.docker_host)
    tmp = Path(_docker_root(client)) / "tmp"
    _clean_dead_staging(tmp)
    staged = prestaging.claim(client, ck, digest) if ck.has_runtime else None
    if staged is not None:  # pre-staged and verified against this very manifest
        hook("staged")
        fs = _Staged.ready(ck, "file-system layer", staged / "layer")
        images: _Staged | None = _Staged.ready(ck, "runtime images", staged / "images")
    else:
        # unpack + verify both artifacts on Docker's disk while the old container is fenced
        # and the new one created; each is then moved into place with one rename
        fs = _Staged(ck, "file-system layer", tmp, lambda d: layer.install(
            Path(ck.path) / "layer.tar", d, data["files"]["layer.tar"]))
        images = _Staged(ck, "runtime images", tmp, lambda d: runtime.install(
            Path(ck.path), data["files"], d)) if ck.has_runtime else None
    cid, fenced, degraded = None, [], not ck.has_runtime
    try:
        fenced = _kill_all(client, ck.sandbox)
        cid = _create(client, ck, data)
        hook("created")
        fs.move_to(_upper(client, cid))
        hook("layer_installed")
        if images is not None:
            images.move_to(Path(_docker_root(client)) / "containers" / cid / "checkpoints" / RESTORE_NAME)
            hook("runtime_verified")
            try:
                runtime.start_from(client, cid, RESTORE_NAME)
            except (docker.errors.APIError, BelayerError) as e:
                _remove(client, cid)
                cid = None
                if not allow_degraded:
                    raise RestoreFailed(f"checkpoint {ck.id}: CRIU restore failed: {_short(e)}",
                                        checkpoint=ck.id) from e
                degraded = True
                cid = _create(client, ck, data)
                layer.install(Path(ck.path) / "layer.tar", _upper(client, cid), data["files"]["layer.tar"])
        if degraded:
            with translate_errors(f"start restored sandbox {ck.sandbox}"):
                client.api.start(cid)
        hook("started")
        _wait_running(client, cid, ck)
        hook("verified")
    except Exception as e:
        if cid is not None:
            _remove_quietly(client, cid)
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
        _remove_in_background(client, fenced)  # after the restore: no disk contention with it
    sandbox = DockerSandbox.attach(cid, ck.config, ck.sandbox, client)
    sandbox.restored_from = ck.id
    sandbox.degraded = degraded
    return sandbox


def fence(client: Any, sandbox_name: str, *, background: bool = True) -> list[str]:
    """Kill every container of ``sandbox_name`` (by name and label) and free the name.

    Once this returns, none of them runs and the name is free. Removing a big writable
    layer is slow on a discard-mounted disk (seconds), so by default the killed containers
    are renamed aside and removed on a background thread (``belayer gc`` reaps any that
    a dying process leaves behind).
    """
    if not background:
        found = _containers_of(client, sandbox_name)
        for cid in found:
            _remove(client, cid)
        return found
    killed = _kill_all(client, sandbox_name)
    _remove_in_background(client, killed)
    return killed


def _containers_of(client: Any, sandbox_name: str) -> list[str]:
    with translate_errors(f"fence sandbox {sandbox_name}"):
        found = {c["Id"] for c in client.api.containers(all=True, filters={"name": f"^/{sandbox_name}$"})}
        found |= {c["Id"] for c in client.api.containers(all=True, filters={"label": f"{SANDBOX_NAME}={sandbox_name}"})}
    return sorted(found)


def _kill_all(client: Any, sandbox_name: str) -> list[str]:
    """Kill + rename aside every container of the sandbox; return those left to remove."""
    with translate_errors(f"fence sandbox {sandbox_name}"):
        return [cid for cid in _containers_of(client, sandbox_name) if _kill_and_rename(client, cid, sandbox_name)]


def _remove_in_background(client: Any, cids: list[str]) -> None:
    for cid in cids:
        threading.Thread(target=_remove_quietly, args=(client, cid), daemon=True,
                         name=f"belayer-fence-{cid[:12]}").start()


def _kill_and_rename(client: Any, cid: str, sandbox_name: str) -> bool:
    """SIGKILL (docker waits for the exit) and rename aside; False if already gone."""
    try:
        info = client.api.inspect_container(cid)
        if info["State"].get("Running"):
            if info["State"].get("Paused"):
                client.api.unpause(cid)
            client.api.kill(cid)
        if not info["Name"].lstrip("/").startswith(f"{sandbox_name}-fenced-"):
            client.api.rename(cid, f"{sandbox_name}-fenced-{uuid.uuid4().hex[:8]}")
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError:
        _remove(client, cid)  # could not kill/rename: remove it here and now
        return False
    deadline = time.monotonic() + RUNNING_TIMEOUT_S
    try:
        while client.api.inspect_container(cid)["State"].get("Running"):
            if time.monotonic() > deadline:
                raise RestoreFailed(f"could not fence container {cid[:12]} of sandbox {sandbox_name}: still running")
            time.sleep(0.01)
    except docker.errors.NotFound:
        return False  # removed meanwhile (e.g. by a concurrent fence): fenced all the same
    return True


def _remove_quietly(client: Any, cid: str) -> None:
    with contextlib.suppress(Exception):
        _remove(client, cid)


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

    def move_to(self, dest: Path) -> None:
        """Put the verified content at ``dest`` (an empty dir there is replaced)."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise RestoreFailed(f"checkpoint {self.ck.id}: {self.what} unusable: {_short(self.error)}",
                                checkpoint=self.ck.id) from self.error
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if dest.is_dir():
            dest.rmdir()
        os.rename(self.dir, dest)

    def discard(self) -> None:
        if self._thread is not None:
            self._thread.join()
        shutil.rmtree(self.dir, ignore_errors=True)


_clean_dead_staging = prestaging.clean_dead_staging


def _create(client: Any, ck: Checkpoint, data: dict[str, Any]) -> str:
    """A created (not started) container with the checkpoint's settings and exact image."""
    config = ck.config.model_copy(update={"image": data.get("image_id") or ck.config.image})
    return create_container(client, config, ck.sandbox).id


def _upper(client: Any, cid: str) -> Path:
    with translate_errors("inspect restored sandbox"):
        return layer.upper_dir(client.api.inspect_container(cid))


def _wait_running(client: Any, cid: str, ck: Checkpoint) -> None:
    """Bounded check that the restored container runs (a failed CRIU restore exits it)."""
    deadline = time.monotonic() + RUNNING_TIMEOUT_S
    while True:
        with translate_errors(f"inspect restored sandbox {ck.sandbox}"):
            state = client.api.inspect_container(cid)["State"]
        if state.get("Running"):
            return
        if state.get("Status") in ("exited", "dead") or time.monotonic() > deadline:
            _remove(client, cid)
            raise RestoreFailed(f"checkpoint {ck.id}: restored container is not running "
                                f"({state.get('Status')}: {state.get('Error') or state.get('ExitCode')})",
                                checkpoint=ck.id)
        time.sleep(0.02)


_docker_root = prestaging.docker_root


def _remove(client: Any, cid: str) -> None:
    with contextlib.suppress(docker.errors.NotFound):
        client.api.remove_container(cid, force=True, v=True)


def _short(e: BaseException) -> str:
    text = str(getattr(e, "explanation", "") or e).strip().splitlines()
    return text[-1][:600] if text else type(e).__name__
