"""``full_restore``: a fresh container at a checkpoint's boundary (layer + CRIU runtime).

The request is checked and what it restores from and into is chosen first (``plan.py``);
this module carries the plan out (``_Restoring``). Order: read the manifest -> claim a copy pre-staged against exactly this manifest
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
import time
import uuid
from pathlib import Path

import docker

from belayer_core.errors import BelayerError, RestoreFailed
from belayer_env.common.background import Background
from belayer_env.common.phases import Phase, PhaseHook
from belayer_env.criu import runtime
from belayer_env.host import loopback
from belayer_env.restore import ctrd_copies, prestaging
from belayer_env.restore.cleanup import clean_later, discard_later, discard_now
from belayer_env.restore.containers import (
    attach_precreated,
    create,
    fence_all_but,
    fence_nothing,
    fit_spare,
)
from belayer_env.restore.plan import DEFAULT_IMAGES, Images, RestorePlan, RestoreRequest, plan
from belayer_env.restore.spare import RestoreSpare, Slot
from belayer_env.restore.staged import (
    RESTORE_NAME,
    in_memory_links,
    point_checkpoints_at,
    remove_links,
    short_error,
    unpoint,
)
from belayer_env.sandbox import fence, removal, writeback
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.removal import remove, remove_quietly
from belayer_env.store import layer, shared_layer
from belayer_env.store.manifest import Checkpoint

__all__ = ["DEFAULT_IMAGES", "Images", "RestoreRequest", "full_restore", "run_restore"]

RUNNING_TIMEOUT_S = 30.0


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
    return run_restore(RestoreRequest(
        checkpoint, allow_degraded=allow_degraded, client=client, phase_hook=phase_hook, name=name,
        use_staged=use_staged, images=images, shared=shared, verified_images=verified_images,
        fence_first=fence_first, precreated=precreated, spare=spare, config=config))


def run_restore(request: RestoreRequest) -> DockerSandbox:
    """``full_restore`` of one request: its plan (``plan.plan``: checked, the unpacks begun),
    then the doing."""
    return _Restoring(plan(request)).run()


class _Restoring:
    """The doing of one plan: verify, create and fence side by side, install the layer and
    the images, take the name, start, check. What it made is removed if it fails."""

    def __init__(self, plan: RestorePlan):
        self.plan = plan
        self.cid: str | None = None
        self.info: dict = {}  # Docker's inspect of the new container
        self.fenced: list[str] = []  # the old containers, killed
        self.degraded = not plan.ck.has_runtime
        self.linking: Background | None = None  # the linked images directory, being made
        self.images_dir: Path | None = None
        self.pointed: Path | None = None  # the container's checkpoints directory, a symlink for the start
        self.nonce: str | None = None  # names containerd's copy of the images once the start has run
        self.layer_fs: Path | None = None  # where this restore wrote the layer (not a pre-made file system)
        self.layer_ns = 0  # when the whole layer was in place, before anything of the container ran

    def run(self) -> DockerSandbox:
        p, ck = self.plan, self.plan.ck
        succeeded = False
        try:
            self._verify_first()
            self._install()
            with translate_errors(f"name restored sandbox {p.target}"):
                p.client.api.rename(self.cid, p.target)
            self._start()
            p.hook(Phase.STARTED)
            _wait_running(p.client, self.cid, ck,
                          loopback_hook=bool(p.data.get("network_disabled")) and not self.degraded)
            fence.wait_not_running(p.client, self.fenced, p.target)  # long true in Docker's view too, by now
            p.hook(Phase.VERIFIED)
            succeeded = True
        except Exception as e:
            if self.cid is not None:
                remove_quietly(p.client, self.cid)
            if isinstance(e, RestoreFailed):
                raise
            if isinstance(e, layer.LayerError):
                raise RestoreFailed(f"checkpoint {ck.id}: file-system layer unusable: {e}", checkpoint=ck.id) from e
            raise RestoreFailed(f"restore of checkpoint {ck.id} failed: {short_error(e)}", checkpoint=ck.id) from e
        finally:
            self._clean_up(succeeded)
        sandbox = DockerSandbox.attach(self.cid, ck.config, p.target, p.client)
        sandbox.restored_from = ck.id
        # its upperdir holds only its own writes under a shared layer: no layer of its own was installed
        sandbox.layer_installed_ns = self.layer_ns if p.request.shared is None else None
        sandbox.degraded = self.degraded
        return sandbox

    def _verify_first(self) -> None:
        """Every artifact checked before anything touches the sandbox of that name (a fork's
        is new: its parts may still be verified while its container is made)."""
        p = self.plan
        if p.request.shared is None or p.target == p.ck.sandbox:
            for part in (p.layer, p.images):
                if part is not None:
                    part.verified()

    def _install(self) -> None:
        """The old containers are listed and die while the new one is created (or taken) and
        filled under a name of its own (labelled as the sandbox: found by the fence from then
        on, so the listing, which runs alongside the create, leaves out only that name); it
        takes the sandbox's name, and starts, only once every one of them is dead."""
        p = self.plan
        new_name = f"{p.target}-restoring-{uuid.uuid4().hex[:8]}"
        killing: Background | None = None
        # the linked images directory is made while Docker creates the container (~30 links
        # + a nonce): beside the images where they are in memory (``Staged.links``), else on
        # Docker's disk, then put into place with one rename
        if p.images is not None and p.via == "linked":
            self.linking = Background(p.images.links, p.tmp)
        try:
            self.cid, self.info = self._container(new_name)
            # Docker made it: only now does the live sandbox of this name die (a container
            # Docker refuses to create leaves it running); it dies while the layer goes in
            killing = Background(fence_all_but if p.request.fence_first else fence_nothing, p.client, p.target,
                                 new_name)
            p.hook(Phase.CREATED)
            if p.layer is not None:
                self.layer_fs = layer.upper_dir(self.info)
                p.layer.move_to(self.layer_fs)
            elif p.request.shared is not None:
                p.request.shared.wait_ready()  # unpacked and verified (made beside the creates: ``fork``)
            self.layer_ns = time.time_ns()
            p.hook(Phase.LAYER_INSTALLED)
            if p.images is not None:
                self._install_images()
                p.hook(Phase.RUNTIME_VERIFIED)
        finally:
            try:
                self.fenced = killing.result() if killing is not None else []
            finally:
                if self.linking is not None:  # made (or not), never put in place: a failure
                    with contextlib.suppress(Exception):
                        remove_links(self.linking.result()[0])

    def _container(self, new_name: str) -> tuple[str, dict]:
        """Into: the pooled container, else the spare if this checkpoint fits it, else a new one."""
        p, r = self.plan, self.plan.request
        if r.precreated is not None and r.shared is not None:
            attach_precreated(p.client, r.precreated, r.shared)
            return r.precreated.container_id, r.precreated.inspect
        if r.spare is not None and (spared := next(iter(r.spare.take_for(p.ck.config, p.data, 1)), None)) is not None:
            fit_spare(p.client, spared, p.ck, p.layer_image)
            return spared.container_id, spared.inspect
        return create(p.client, p.ck, p.data, new_name, p.target, p.layer_image, r.shared)

    def _install_images(self) -> None:
        """The verified images into the container's checkpoint directory: links (moved in,
        or the directory pointed at them where they are in memory), or the files themselves."""
        p = self.plan
        assert p.images is not None and self.cid is not None
        self.images_dir = Path(prestaging.docker_root(p.client)) / "containers" / self.cid / "checkpoints" / RESTORE_NAME
        if self.linking is None:  # copied
            p.images.move_to(self.images_dir)
            self.nonce = ctrd_copies.write_nonce(self.images_dir)
            return
        link_dir, self.nonce = self.linking.result()
        self.linking = None
        if not in_memory_links(link_dir):
            self.images_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.rename(link_dir, self.images_dir)
        elif point_checkpoints_at(self.images_dir.parent, link_dir.parent):
            self.pointed = self.images_dir.parent
            self.images_dir = link_dir.parent  # spent with the images
        else:  # the container's checkpoints directory holds something: links on its disk
            remove_links(link_dir)
            self.nonce = p.images.link_into(self.images_dir)

    def _start(self) -> None:
        """Start from the checkpoint; where CRIU refuses and ``allow_degraded``, a new container
        with the layer only (reported: ``degraded``)."""
        p, ck = self.plan, self.plan.ck
        if p.images is not None:
            try:
                runtime.start_from(p.client, self.cid, RESTORE_NAME)
            except (docker.errors.APIError, BelayerError) as e:
                remove(p.client, self.cid)
                self.cid = None
                if not p.request.allow_degraded:
                    raise RestoreFailed(f"checkpoint {ck.id}: CRIU restore failed: {short_error(e)}",
                                        checkpoint=ck.id) from e
                self.degraded = True
                self.cid, self.info = create(p.client, ck, p.data, p.target, p.target, shared=p.request.shared)
                if p.request.shared is None:
                    self.layer_fs = layer.upper_dir(self.info)
                    layer.install(Path(ck.path) / "layer.tar", self.layer_fs, p.data["files"]["layer.tar"])
                self.layer_ns = time.time_ns()
        if self.degraded:
            with translate_errors(f"start restored sandbox {ck.sandbox}"):
                p.client.api.start(self.cid)

    def _clean_up(self, succeeded: bool) -> None:
        """Restored (or failed): CRIU has read the images; the unpacked copies are spent.
        Deleting them (thousands of files for a copied layer: seconds under load) is not part
        of a successful restore: a thread does it (``wait_cleaned``); a failed one cleans up
        before it raises."""
        p = self.plan
        spent = [d for d in (self.images_dir, p.staged) if d is not None]
        parts = [s for s in (p.layer, p.images) if s is not None]
        nonces = [self.nonce] if self.nonce is not None else []  # containerd's copy (``ctrd_copies``)
        if succeeded:
            discard_later(spent, parts, nonces)
            if self.pointed is not None:
                clean_later(unpoint, self.pointed)
            # what this restore wrote (a layer copied into a capped file system: its own
            # file system, then Docker's, which holds its image) is not left for the next
            # restore's fsyncs to wait for (``writeback``)
            writeback.flush_later(*([self.layer_fs] if self.layer_fs is not None else []), p.tmp)
        else:
            discard_now(spent, parts, nonces)
        removal.remove_in_background(p.client, self.fenced)  # after the restore: no disk contention with it


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
