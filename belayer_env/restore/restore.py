"""``full_restore``: a fresh container at a checkpoint's boundary (layer + CRIU runtime).

Order: read the manifest -> claim a copy pre-staged against exactly this manifest
(``prestaging``: unpacked + verified ahead of time) or else, on two threads, unpack the
layer and link/copy the CRIU images onto Docker's disk, checking every byte against the
manifest -> only once every artifact is verified, fence every container of that sandbox
(killed, renamed aside; removed after the restore) while a container with the same
settings and the exact image the checkpoint was taken on is created under a name of its
own (labelled as the sandbox) and gets the verified layer (renamed into its empty
upperdir, or, pre-staged for a disk-capped sandbox, its whole file system mounted) and
the images in its checkpoint directory -> once the old ones are dead, it takes the
sandbox's name -> start from the checkpoint -> check it runs. Nothing is started from bytes that disagree with the
manifest, and a corrupt or incomplete checkpoint (``RestoreFailed`` naming the artifact)
leaves a live sandbox of that name untouched. A checkpoint without
runtime state, or whose runtime CRIU refuses, is restored file-system-only only when the
caller passes ``allow_degraded=True``; the result then says ``.degraded = True``.

How the CRIU images reach CRIU (``images=``, default ``DEFAULT_IMAGES``, env
``BELAYER_RESTORE_IMAGES``): ``"linked"`` leaves them where they were verified and puts
only relative symlinks into the container's checkpoint directory, so Docker's start tars,
hashes and stores a few hundred bytes in containerd's content store and containerd
unpacks as little, instead of the whole memory dump twice (CRIU follows the links; see
docs/restore.md). ``"copied"`` moves the images themselves into that directory
(Docker's own way). Either way Docker, containerd and the shim own the restored
container: ``docker ps``/``exec``/``stop``/``rm`` and a later checkpoint see an ordinary
running container.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import docker

from belayer_core.errors import BelayerError, RestoreFailed, UsageError
from belayer_env.background import Background
from belayer_env.criu import runtime
from belayer_env.host import loopback
from belayer_env.phases import Phase, PhaseHook, no_hook
from belayer_env.restore import ctrd_copies, prestaging
from belayer_env.restore.cleanup import (
    clean_later,
    discard_later,
    discard_now,
)
from belayer_env.restore.staged import (
    RESTORE_NAME,
    Staged,
    in_memory_links,
    install_images,
    point_checkpoints_at,
    remove_links,
    short_error,
    unpack_layer,
    unpoint,
)
from belayer_env.restore.trust import check_bounded
from belayer_env.sandbox import disk, fence, writeback
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox, create_container
from belayer_env.sandbox.docker_api import connect, translate_errors
from belayer_env.sandbox.fence import remove, remove_quietly
from belayer_env.sandbox.ownership import SANDBOX_NAME
from belayer_env.store import layer, shared_layer
from belayer_env.store.manifest import Checkpoint, read_manifest_digest

if TYPE_CHECKING:
    from belayer_env.restore.spare import RestoreSpare, Slot

RUNNING_TIMEOUT_S = 30.0
Images = Literal["linked", "copied"]
DEFAULT_IMAGES: str = os.environ.get("BELAYER_RESTORE_IMAGES", "linked")
"""Chosen by measurement (benchmarks/checkpoint_bench.py, docs/restore.md)."""


def full_restore(checkpoint: Checkpoint, *, allow_degraded: bool = False, client: docker.DockerClient | None = None,
                 phase_hook: PhaseHook | None = None, name: str | None = None,
                 use_staged: bool = True, images: Images | None = None,
                 shared: shared_layer.SharedLower | None = None,
                 verified_images: Path | concurrent.futures.Future[Path] | None = None,
                 fence_first: bool = True, precreated: Slot | None = None,
                 spare: RestoreSpare | None = None, config: SandboxConfig | None = None) -> DockerSandbox:
    """Restore ``checkpoint`` into a fresh container; raise ``RestoreFailed`` naming it.

    ``name``: restore as this sandbox (fenced instead of the checkpoint's own name; what
    ``fork`` and the standby use). ``use_staged=False`` leaves a pre-staged copy for the
    sandbox's own restore. ``images``: how the CRIU images reach CRIU (module docstring).
    ``shared``: the checkpoint's layer unpacked as a shared lower layer (``fork``): the
    container gets it as its top lower layer and an empty upperdir (``shared_layer``); a
    fork's name is new, so its container is created while that layer (``wait_ready``) and
    ``verified_images`` may still be being verified: nothing starts before both are.
    ``verified_images``: a directory (or the future of one) of the checkpoint's runtime images
    verified against this manifest (``fork``: once for all forks); hardlinked, not hashed again.
    ``fence_first=False``: no container can hold ``name`` (``fork``'s generated names, a
    random suffix each), so none is listed and killed first (if one did, taking the name fails).
    ``precreated``: a pooled container (``fork_pool``) created for sandbox ``name`` with this
    checkpoint's image and settings, used instead of a create (with ``shared`` only).
    ``spare``: its container is used instead of a create when this checkpoint was taken of
    a container made like it (``restore.spare.RestoreSpare``; an unshared restore).
    ``config``: the restoring side's settings (the env's; default: ``SandboxConfig()``, the
    secure defaults): the checkpoint's recorded image, network, capabilities, limits and
    daemon may be narrower, never wider (``trust``: refused before anything is fenced).

    Everything checkable is checked before the live sandbox of that name is fenced: the
    manifest, the settings, every artifact's bytes, and that Docker creates the container.
    """
    via = images or DEFAULT_IMAGES
    if via not in get_args(Images):
        raise UsageError(f"images must be one of {get_args(Images)}, got {via!r} (BELAYER_RESTORE_IMAGES?)")
    hook = phase_hook or no_hook
    ck = checkpoint
    target = name or ck.sandbox
    if precreated is not None and (shared is None or precreated.target != target or not precreated.alias):
        raise UsageError("a pooled container serves a shared fork, under the name it was created for")
    if spare is not None and shared is not None:
        raise UsageError("a restore spare serves a restore with a layer of its own, not a shared fork")
    try:
        data, digest = read_manifest_digest(Path(ck.path))
    except ValueError as e:
        raise RestoreFailed(f"checkpoint {ck.id} is incomplete: {e}", checkpoint=ck.id) from e
    if not ck.has_runtime and not allow_degraded:
        raise RestoreFailed(f"checkpoint {ck.id} holds no runtime state; a file-system-only restore "
                            "needs allow_degraded=True", checkpoint=ck.id)
    if data.get("network_disabled") and not loopback.installed():  # before anything touches the sandbox
        raise RestoreFailed(f"checkpoint {ck.id} was taken of a sandbox without Docker's network stack and "
                            f"this host lacks the CRIU loopback hook that restores need ({loopback.HOOK_PATH} "
                            f"listed in {loopback.RUNC_CRIU_CONF}): run `bash scripts/setup.sh`", checkpoint=ck.id)
    client = client or connect((config or SandboxConfig()).docker_host)  # never the manifest's daemon
    check_bounded(client, ck, data, config)
    tmp = prestaging.docker_tmp(client)
    prestaging.clean_dead_staging(tmp)
    staged = prestaging.claim(client, ck, digest) if ck.has_runtime and use_staged and shared is None else None
    layer_image: Path | None = None
    if staged is not None:  # pre-staged and verified against this very manifest
        hook(Phase.STAGED)
        if (staged / prestaging.LAYER_IMAGE).is_file() and ck.config.disk_bytes is not None:
            layer_image = staged / prestaging.LAYER_IMAGE  # the new layer's file system, filled
            fs: Staged | None = None
        else:
            fs = Staged.ready(ck, "file-system layer", staged / "layer")
        runtime_images: Staged | None = Staged.ready(ck, "runtime images", staged / "images")
    else:
        # unpack + verify both artifacts on Docker's disk (a capped layer: in memory where it
        # fits), side by side; each is then moved into place with one rename, or copied into
        # a capped file system (the layer: not at all when it is a shared lower layer)
        fs = None if shared is not None else Staged(ck, "file-system layer", tmp, lambda d: unpack_layer(ck, data, d))
        runtime_images = (None if not ck.has_runtime else
                          Staged.borrowed(ck, "runtime images", verified_images) if verified_images is not None else
                          Staged(ck, "runtime images", tmp, lambda d: install_images(ck, data, d)))
    cid, fenced, degraded = None, [], not ck.has_runtime
    images_dir: Path | None = None
    pointed: Path | None = None  # the container's checkpoints directory, a symlink for the start
    nonce: str | None = None  # names containerd's copy of the images once the start has run
    layer_fs: Path | None = None  # where this restore wrote the layer (not a pre-made file system)
    try:
        for part in (fs, runtime_images) if shared is None or target == ck.sandbox else ():
            if part is not None:
                part.verified()  # before anything touches the sandbox of that name (a fork's is new)
        # the old containers are listed and die while the new one is created and filled under
        # a name of its own (labelled as ``target``: found by the fence from then on, so the
        # listing, which runs alongside the create, leaves out only that name); it takes the
        # sandbox's name, and starts, only once every one of them is dead
        new_name = f"{target}-restoring-{uuid.uuid4().hex[:8]}"
        killing: Background | None = None
        # the linked images directory is made while Docker creates the container (~30 links
        # + a nonce): beside the images where they are in memory (``Staged.links``), else on
        # Docker's disk, then put into place with one rename
        linking = Background(runtime_images.links, tmp) if runtime_images is not None and via == "linked" else None
        try:
            if precreated is not None:
                cid, info = precreated.container_id, precreated.inspect
                _attach_precreated(client, cid, info, shared, precreated.alias)
            elif spare is not None and (spared := next(iter(spare.take_for(ck.config, data, 1)), None)) is not None:
                cid, info = spared.container_id, spared.inspect
                _fit_spare(client, cid, info, ck, layer_image)
            else:
                cid, info = _create(client, ck, data, new_name, target, layer_image, shared)
            # Docker made it: only now does the live sandbox of this name die (a container
            # Docker refuses to create leaves it running); it dies while the layer goes in
            killing = Background(_fence_all_but if fence_first else _nothing, client, target, new_name)
            hook(Phase.CREATED)
            if fs is not None:
                layer_fs = layer.upper_dir(info)
                fs.move_to(layer_fs)
            elif shared is not None:
                shared.wait_ready()  # unpacked and verified (made beside the creates: ``fork``)
            layer_ns = time.time_ns()  # the whole layer is in place (moved or mounted), nothing of the container ran yet
            hook(Phase.LAYER_INSTALLED)
            if runtime_images is not None:
                images_dir = Path(prestaging.docker_root(client)) / "containers" / cid / "checkpoints" / RESTORE_NAME
                if linking is not None:
                    link_dir, nonce = linking.result()
                    linking = None
                    if not in_memory_links(link_dir):
                        images_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                        os.rename(link_dir, images_dir)
                    elif point_checkpoints_at(images_dir.parent, link_dir.parent):
                        pointed = images_dir.parent
                        images_dir = link_dir.parent  # spent with the images
                    else:  # the container's checkpoints directory holds something: links on its disk
                        remove_links(link_dir)
                        nonce = runtime_images.link_into(images_dir)
                else:
                    runtime_images.move_to(images_dir)
                    nonce = ctrd_copies.write_nonce(images_dir)
                hook(Phase.RUNTIME_VERIFIED)
        finally:
            try:
                fenced = killing.result() if killing is not None else []
            finally:
                if linking is not None:  # made (or not), never put in place: a failure
                    with contextlib.suppress(Exception):
                        remove_links(linking.result()[0])
        with translate_errors(f"name restored sandbox {target}"):
            client.api.rename(cid, target)
        if runtime_images is not None:
            try:
                runtime.start_from(client, cid, RESTORE_NAME)
            except (docker.errors.APIError, BelayerError) as e:
                remove(client, cid)
                cid = None
                if not allow_degraded:
                    raise RestoreFailed(f"checkpoint {ck.id}: CRIU restore failed: {short_error(e)}",
                                        checkpoint=ck.id) from e
                degraded = True
                cid, info = _create(client, ck, data, target, target, shared=shared)
                if shared is None:
                    layer_fs = layer.upper_dir(info)
                    layer.install(Path(ck.path) / "layer.tar", layer_fs, data["files"]["layer.tar"])
                layer_ns = time.time_ns()
        if degraded:
            with translate_errors(f"start restored sandbox {ck.sandbox}"):
                client.api.start(cid)
        hook(Phase.STARTED)
        _wait_running(client, cid, ck, loopback_hook=bool(data.get("network_disabled")) and not degraded)
        fence.wait_not_running(client, fenced, target)  # long true in Docker's view too, by now
        hook(Phase.VERIFIED)
    except Exception as e:
        if cid is not None:
            remove_quietly(client, cid)
        if isinstance(e, RestoreFailed):
            raise
        if isinstance(e, layer.LayerError):
            raise RestoreFailed(f"checkpoint {ck.id}: file-system layer unusable: {e}", checkpoint=ck.id) from e
        raise RestoreFailed(f"restore of checkpoint {ck.id} failed: {short_error(e)}", checkpoint=ck.id) from e
    finally:
        # restored (or failed): CRIU has read the images; the unpacked copies are spent.
        # Deleting them (thousands of files for a copied layer: seconds under load) is not
        # part of a successful restore: a thread does it (``wait_cleaned``); a failed one
        # cleans up before it raises
        spent = [p for p in (images_dir, staged) if p is not None]
        parts = [p for p in (fs, runtime_images) if p is not None]
        nonces = [nonce] if nonce is not None else []  # containerd's copy (``ctrd_copies``)
        if sys.exc_info()[0] is None:
            discard_later(spent, parts, nonces)
            if pointed is not None:
                clean_later(unpoint, pointed)
            # what this restore wrote (a layer copied into a capped file system: its own
            # file system, then Docker's, which holds its image) is not left for the next
            # restore's fsyncs to wait for (``writeback``)
            writeback.flush_later(*([layer_fs] if layer_fs is not None else []), tmp)
        else:
            discard_now(spent, parts, nonces)
        fence.remove_in_background(client, fenced)  # after the restore: no disk contention with it
    sandbox = DockerSandbox.attach(cid, ck.config, target, client)
    sandbox.restored_from = ck.id
    sandbox.layer_installed_ns = layer_ns if shared is None else None  # its upperdir holds only its own writes
    sandbox.degraded = degraded
    return sandbox


def _fence_all_but(client: docker.DockerClient, target: str, new_name: str) -> list[str]:
    """Kill every container of sandbox ``target`` except this restore's own (``new_name``)."""
    listed = [c for c in fence.sandbox_containers(client, target, by_name=True)
              if f"/{new_name}" not in (c.get("Names") or ())]
    return fence.kill_listed(client, target, listed, docker_view=False)  # dead is enough to start; Docker's view: after the start


def _nothing(*_args: Any) -> list[str]:
    return []


def _create(client: docker.DockerClient, ck: Checkpoint, data: dict[str, Any], name: str, sandbox: str,
            layer_image: Path | None = None,
            shared: shared_layer.SharedLower | None = None) -> tuple[str, dict[str, Any]]:
    """A created (not started) container with the checkpoint's settings and exact image,
    named ``name`` and labelled as sandbox ``sandbox``, and Docker's inspect of it; with
    ``layer_image`` (pre-staged, layer inside) that file system is mounted as its
    disk-capped layer instead of an empty one; with ``shared``, that layer goes on top of
    its lower layers (and its label on it)."""
    update: dict[str, Any] = {"image": data.get("image_id") or ck.config.image}
    if layer_image is not None:
        update["disk"] = None  # the cap is layer_image's own size
    labels = {SANDBOX_NAME: sandbox, **(shared.labels if shared is not None else {})}
    container = create_container(client, ck.config.model_copy(update=update), name, labels=labels,
                                 network_disabled=bool(data.get("network_disabled")))
    info = container.attrs  # docker-py inspected it right after the create
    if shared is not None:
        try:
            shared.attach(info)
        except BaseException:
            remove_quietly(client, container.id)
            raise
    if layer_image is not None:
        try:
            disk.mount_layer_image(info, layer_image)
        except BaseException:
            remove_quietly(client, container.id)
            raise
    return container.id, info


def _attach_precreated(client: docker.DockerClient, cid: str, info: dict[str, Any],
                       shared: shared_layer.SharedLower, alias: str) -> None:
    """A pooled container onto the shared layer: its alias names the copy, then its lowers."""
    try:
        shared_layer.make_alias(shared, alias)
        shared.attach(info)
    except BaseException:
        remove_quietly(client, cid)
        raise


def _fit_spare(client: docker.DockerClient, cid: str, info: dict[str, Any], ck: Checkpoint,
               layer_image: Path | None) -> None:
    """A spare (created without a disk cap) gets what ``_create`` gives a new container:
    the pre-staged layer file system mounted as its layer, or else the checkpoint's cap."""
    try:
        if layer_image is not None:
            disk.mount_layer_image(info, layer_image)
        elif ck.config.disk_bytes is not None:
            disk.limit_layer(info, ck.config.disk_bytes)
    except BaseException:
        remove_quietly(client, cid)
        raise


def _wait_running(client: docker.DockerClient, cid: str, ck: Checkpoint, *, loopback_hook: bool) -> None:
    """Bounded check that the restored container runs (a failed CRIU restore exits it);
    ``loopback_hook``: and that the CRIU hook set its loopback up (``belayer_env.host.loopback``)."""
    deadline = time.monotonic() + RUNNING_TIMEOUT_S
    while True:
        with translate_errors(f"inspect restored sandbox {ck.sandbox}"):
            state = client.api.inspect_container(cid)["State"]
        if state.get("Running"):
            if loopback_hook and loopback.loopback_up(state.get("Pid", 0)) is False:
                remove(client, cid)
                raise RestoreFailed(f"checkpoint {ck.id}: the restored sandbox's loopback is down (the CRIU "
                                    f"loopback hook did not run: is {loopback.CONF_LINE!r} still in "
                                    f"{loopback.RUNC_CRIU_CONF}? `bash scripts/setup.sh` puts it back)",
                                    checkpoint=ck.id)
            return
        if state.get("Status") in ("exited", "dead") or time.monotonic() > deadline:
            remove(client, cid)
            raise RestoreFailed(f"checkpoint {ck.id}: restored container is not running "
                                f"({state.get('Status')}: {state.get('Error') or state.get('ExitCode')})",
                                checkpoint=ck.id)
        time.sleep(0.02)
