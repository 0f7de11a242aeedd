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
docs/checkpoint.md). ``"copied"`` moves the images themselves into that directory
(Docker's own way). Either way Docker, containerd and the shim own the restored
container: ``docker ps``/``exec``/``stop``/``rm`` and a later checkpoint see an ordinary
running container.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import docker

from belayer.errors import BelayerError, RestoreFailed, UsageError
from belayer_env import disk, fence, loopback, writeback
from belayer_env.background import Background, ThreadSet
from belayer_env.checkpoint import ctrd_copies, in_memory, layer, prestaging, runtime, shared_layer
from belayer_env.checkpoint.manifest import Checkpoint, read_manifest_digest
from belayer_env.checkpoint.store import owner_tag
from belayer_env.docker_api import connect, translate_errors
from belayer_env.fence import remove, remove_quietly
from belayer_env.ownership import SANDBOX_NAME
from belayer_env.phases import Phase, PhaseHook, no_hook
from belayer_env.sandbox import DockerSandbox, create_container

if TYPE_CHECKING:
    from belayer_env import fork_pool

RESTORE_NAME = "belayer"  # Docker's checkpoint name inside the new container's directory
RUNNING_TIMEOUT_S = 30.0
Images = Literal["linked", "copied"]
DEFAULT_IMAGES: str = os.environ.get("BELAYER_RESTORE_IMAGES", "linked")
"""Chosen by measurement (benchmarks/checkpoint_bench.py, docs/checkpoint.md)."""
LINKS_PREFIX = ".links-"
"""A restore's linked images directory beside in-memory images (``_Staged.links``)."""
LINK_UP = "../" * 64
"""Prefix of every image link: containerd unpacks the checkpoint directory into a temporary
directory of its own (depth unknown here), and ``..`` at ``/`` stays at ``/``."""


def full_restore(checkpoint: Checkpoint, *, allow_degraded: bool = False, client: docker.DockerClient | None = None,
                 phase_hook: PhaseHook | None = None, name: str | None = None,
                 use_staged: bool = True, images: Images | None = None,
                 shared: shared_layer.SharedLower | None = None,
                 verified_images: Path | concurrent.futures.Future[Path] | None = None,
                 fence_first: bool = True, precreated: fork_pool.Slot | None = None,
                 spare: fork_pool.RestoreSpare | None = None) -> DockerSandbox:
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
    a container made like it (``fork_pool.RestoreSpare``; an unshared restore).
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
    client = client or connect(ck.config.docker_host)
    tmp = prestaging.docker_tmp(client)
    prestaging.clean_dead_staging(tmp)
    staged = prestaging.claim(client, ck, digest) if ck.has_runtime and use_staged and shared is None else None
    layer_image: Path | None = None
    if staged is not None:  # pre-staged and verified against this very manifest
        hook(Phase.STAGED)
        if (staged / prestaging.LAYER_IMAGE).is_file() and ck.config.disk_bytes is not None:
            layer_image = staged / prestaging.LAYER_IMAGE  # the new layer's file system, filled
            fs: _Staged | None = None
        else:
            fs = _Staged.ready(ck, "file-system layer", staged / "layer")
        runtime_images: _Staged | None = _Staged.ready(ck, "runtime images", staged / "images")
    else:
        # unpack + verify both artifacts on Docker's disk (a capped layer: in memory where it
        # fits), side by side; each is then moved into place with one rename, or copied into
        # a capped file system (the layer: not at all when it is a shared lower layer)
        fs = None if shared is not None else _Staged(ck, "file-system layer", tmp, lambda d: _unpack_layer(ck, data, d))
        runtime_images = (None if not ck.has_runtime else
                          _Staged.borrowed(ck, "runtime images", verified_images) if verified_images is not None else
                          _Staged(ck, "runtime images", tmp, lambda d: _install_images(ck, data, d)))
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
        killing = Background(_fence_all_but if fence_first else _nothing, client, target, new_name)
        # the linked images directory is made while Docker creates the container (~30 links
        # + a nonce): beside the images where they are in memory (``_Staged.links``), else on
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
                    if not _in_memory_links(link_dir):
                        images_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                        os.rename(link_dir, images_dir)
                    elif _point_checkpoints_at(images_dir.parent, link_dir.parent):
                        pointed = images_dir.parent
                        images_dir = link_dir.parent  # spent with the images
                    else:  # the container's checkpoints directory holds something: links on its disk
                        _remove_links(link_dir)
                        nonce = runtime_images.link_into(images_dir)
                else:
                    runtime_images.move_to(images_dir)
                    nonce = ctrd_copies.write_nonce(images_dir)
                hook(Phase.RUNTIME_VERIFIED)
        finally:
            try:
                fenced = killing.result()
            finally:
                if linking is not None:  # made (or not), never put in place: a failure
                    with contextlib.suppress(Exception):
                        _remove_links(linking.result()[0])
        with translate_errors(f"name restored sandbox {target}"):
            client.api.rename(cid, target)
        if runtime_images is not None:
            try:
                runtime.start_from(client, cid, RESTORE_NAME)
            except (docker.errors.APIError, BelayerError) as e:
                remove(client, cid)
                cid = None
                if not allow_degraded:
                    raise RestoreFailed(f"checkpoint {ck.id}: CRIU restore failed: {_short(e)}",
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
        raise RestoreFailed(f"restore of checkpoint {ck.id} failed: {_short(e)}", checkpoint=ck.id) from e
    finally:
        # restored (or failed): CRIU has read the images; the unpacked copies are spent.
        # Deleting them (thousands of files for a copied layer: seconds under load) is not
        # part of a successful restore: a thread does it (``wait_cleaned``); a failed one
        # cleans up before it raises
        spent = [p for p in (images_dir, staged) if p is not None]
        parts = [p for p in (fs, runtime_images) if p is not None]
        nonces = [nonce] if nonce is not None else []  # containerd's copy (``ctrd_copies``)
        if sys.exc_info()[0] is None:
            _clean_later(spent, parts, nonces)
            if pointed is not None:
                clean_later(_unpoint, pointed)
            # what this restore wrote (a layer copied into a capped file system: its own
            # file system, then Docker's, which holds its image) is not left for the next
            # restore's fsyncs to wait for (``writeback``)
            writeback.flush_later(*([layer_fs] if layer_fs is not None else []), tmp)
        else:
            _clean(spent, parts, nonces)
        fence.remove_in_background(client, fenced)  # after the restore: no disk contention with it
    sandbox = DockerSandbox.attach(cid, ck.config, target, client)
    sandbox.restored_from = ck.id
    sandbox.layer_installed_ns = layer_ns if shared is None else None  # its upperdir holds only its own writes
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

    @classmethod
    def borrowed(cls, ck: Checkpoint, what: str, src: Path | concurrent.futures.Future[Path]) -> _Staged:
        """Content verified by someone else (``fork``: the images once for every fork), who
        keeps and removes it: used where it is, never moved or discarded here."""
        return _Borrowed(ck, what, src)

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
        """Put the verified content at ``dest`` (a dir there holding only empty dirs is replaced:
        Docker creates a working dir missing from the image in a new container's upperdir)."""
        self.verified()
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if dest.is_dir():
            _remove_empty_tree(dest)
        try:
            os.rename(self.dir, dest)
        except OSError as e:  # a capped sandbox layer is a file system of its own (belayer_env.disk),
            if e.errno not in (errno.EXDEV, errno.EBUSY):  # and the unpack may be a tmpfs (a mount)
                raise
            dest.mkdir(mode=0o755)
            layer.copy_tree(self.dir, dest)

    def links(self, tmp: Path) -> tuple[Path, str]:
        """A directory of links to the verified files (``link_into``) and its nonce. Where
        the files are in memory (a tmpfs of their own), the directory is made there,
        ``<files>/.links-<id>/<RESTORE_NAME>``, and the container's checkpoints directory
        becomes a symlink to its parent (``_point_checkpoints_at``): on the dev VM's ext4 a
        symlink cost ~0.4 ms of CPU, 60-90 of them per restore with the spent directory's
        removal (a third of ``fork(ck, 8)``'s own CPU). Else in Docker's tmp dir, on its
        disk, for a rename into the container's checkpoints directory."""
        self.verified()
        if os.stat(self.dir).st_dev != os.stat(tmp).st_dev:
            dest = self.dir / f"{LINKS_PREFIX}{uuid.uuid4().hex[:12]}" / RESTORE_NAME
            dest.parent.mkdir(mode=0o700)
        else:
            dest = tmp / f"{prestaging.PREFIX}{uuid.uuid4().hex[:12]}~{owner_tag()}"
        try:
            return dest, self.link_into(dest)
        except BaseException:
            _remove_links(dest)
            raise

    def link_into(self, dest: Path) -> str:
        """Make ``dest`` a directory of relative symlinks to the verified files, which stay
        here until ``discard`` (after the restore), and a nonce (returned). The links are
        valid from any directory of the same file system (``LINK_UP``): ``dest`` may be renamed."""
        self.verified()
        dest.mkdir(mode=0o700, parents=True)
        here = str(self.dir.resolve())  # once: a file's own resolve walked the whole path again
        for f in os.scandir(self.dir):
            if f.name.startswith(LINKS_PREFIX):
                continue  # another restore's links (``links``)
            os.symlink(f"{LINK_UP}{here.lstrip('/')}/{f.name}", dest / f.name)
        return ctrd_copies.write_nonce(dest)

    def discard(self) -> None:
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(OSError):
            in_memory.umount(self.dir)  # an in-memory unpack (``_unpack_layer``)
        shutil.rmtree(self.dir, ignore_errors=True)


def _install_images(ck: Checkpoint, data: dict[str, Any], d: Path) -> None:
    """The runtime images, verified, into ``d``: hardlinks where the store is on the same
    mount as Docker's tmp dir (only read, to hash them), else copies, into a tmpfs of its
    own where they fit (as ``fork`` does): a heavy sandbox's 54 MB of pages written onto
    Docker's disk was on the restore's critical path, and then left dirty for the next
    restore's fsyncs (``writeback``)."""
    src = Path(ck.path)
    size = sum(m["size"] for rel, m in data["files"].items() if rel.startswith("runtime/"))
    if not _same_mount(src / "manifest.json", d) and (cap := in_memory.memory_cap(size)) is not None:
        in_memory.try_mount_tmpfs(d, cap, source=in_memory.RESTORE, mode="0700")
    runtime.install(src, data["files"], d)


def _same_mount(src: Path, d: Path) -> bool:
    """Whether a file of ``src``'s can be hardlinked into ``d`` (not across mounts: EXDEV)."""
    probe = d / ".link-probe"
    try:
        os.link(src, probe)
    except OSError:
        return False
    probe.unlink()
    return True


def _unpack_layer(ck: Checkpoint, data: dict[str, Any], d: Path) -> None:
    """Unpack + verify the layer into ``d``. A capped sandbox's layer is copied into its own
    file system afterwards anyway, so it is unpacked into a tmpfs of its own where it fits
    (``in_memory.memory_cap``): creating thousands of files on Docker's ext4 cost seconds
    of kernel time on the dev VM, into tmpfs ~0.1 s."""
    tar = Path(ck.path) / "layer.tar"
    if ck.config.disk_bytes is not None and (cap := in_memory.memory_cap(tar.stat().st_size)) is not None:
        in_memory.try_mount_tmpfs(d, cap, source=in_memory.RESTORE, mode="0700")
    layer.install(tar, d, data["files"]["layer.tar"])


_cleaning = ThreadSet("belayer-restore-clean")


def _clean(paths: list[Path], parts: list[_Staged], nonces: list[str]) -> None:
    for part in parts:
        part.discard()
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    for nonce in nonces:
        ctrd_copies.remove(nonce)


def _clean_later(paths: list[Path], parts: list[_Staged], nonces: list[str]) -> None:
    _cleaning.start(_clean, paths, parts, nonces)


@contextlib.contextmanager
def cleanup_deferred() -> Iterator[None]:
    """Restores that end meanwhile delete their spent copies and write back only when it
    ends (``fork``: eight restores side by side, the first ones' clean-up and ``syncfs``
    would take the CPU and disk from the others still restoring)."""
    with _cleaning.held(), writeback.held():
        yield


def clean_later(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` on a clean-up thread, errors ignored: held like a restore's own clean-up
    (``cleanup_deferred``), awaited by ``wait_cleaned``."""
    def quietly() -> None:
        with contextlib.suppress(Exception):
            fn(*args)

    _cleaning.start(quietly)


def wait_cleaned(timeout_s: float = 120.0) -> bool:
    """Wait for this process's restores to finish deleting their spent copies (``env.close``,
    tests); True when none is left. What a dying process leaves is removed by the next
    restore or prestage (``prestaging.clean_dead_staging``) and ``belayer gc``."""
    return _cleaning.wait(timeout_s)


def _fence_all_but(client: docker.DockerClient, target: str, new_name: str) -> list[str]:
    """Kill every container of sandbox ``target`` except this restore's own (``new_name``)."""
    listed = [c for c in fence.sandbox_containers(client, target, by_name=True)
              if f"/{new_name}" not in (c.get("Names") or ())]
    return fence.kill_listed(client, target, listed, docker_view=False)  # dead is enough to start; Docker's view: after the start


def _nothing(*_args: Any) -> list[str]:
    return []


def _remove_empty_tree(path: Path) -> None:
    """Remove ``path`` if it holds nothing but (empty) directories; ``OSError`` otherwise."""
    for sub in sorted((p for p in path.rglob("*")), key=lambda p: len(p.parts), reverse=True):
        sub.rmdir()  # a file, link or device there raises: never throw content away
    path.rmdir()


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


def _result(src: Path | concurrent.futures.Future[Path]) -> Path:
    return src.result() if isinstance(src, concurrent.futures.Future) else src


class _Borrowed(_Staged):
    """``_Staged.borrowed``: another's verified directory (or the future of one)."""

    def __init__(self, ck: Checkpoint, what: str, src: Path | concurrent.futures.Future[Path]):
        super().__init__(ck, what, Path("/nonexistent"), None)
        self._src = src

    def verified(self) -> None:
        try:
            self.dir = _result(self._src)
        except Exception as e:
            raise RestoreFailed(f"checkpoint {self.ck.id}: {self.what} unusable: {_short(e)}",
                                checkpoint=self.ck.id) from e

    def move_to(self, dest: Path) -> None:
        """Links to the files at ``dest`` (they stay with their owner)."""
        self.verified()
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        dest.mkdir(mode=0o700)
        _link_all(self.dir, dest)

    def discard(self) -> None:
        """Nothing: the owner removes the files."""


def _point_checkpoints_at(own: Path, links: Path) -> bool:
    """Make a created container's checkpoints directory (``own``, empty since its create)
    a symlink to ``links``: Docker resolves ``<own>/<checkpoint name>`` through it, tars what
    it finds there for containerd, and removes only the symlink with the container. Docker
    20.10 refuses a custom ``checkpoint-dir`` with containerd. False if ``own`` holds anything."""
    try:
        own.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    os.symlink(links, own)
    return True


def _unpoint(own: Path) -> None:
    """After the start: the container's checkpoints directory an empty directory again, as
    Docker made it (its own ``docker checkpoint create`` would fail on a dangling symlink)."""
    if own.is_symlink():
        own.unlink()
        own.mkdir(mode=0o700)


def _in_memory_links(link_dir: Path) -> bool:
    return link_dir.parent.name.startswith(LINKS_PREFIX)


def _remove_links(link_dir: Path) -> None:
    shutil.rmtree(link_dir.parent if _in_memory_links(link_dir) else link_dir, ignore_errors=True)


def _link_all(src: Path, dest: Path) -> None:
    """Hardlink every file of ``src`` into ``dest``; symlink where ``src`` is another file
    system (``fork``'s in-memory images, which outlive every fork's restore)."""
    other_fs = os.stat(src).st_dev != os.stat(dest).st_dev
    for f in src.iterdir():
        if f.name.startswith(LINKS_PREFIX):
            continue
        if other_fs:
            os.symlink(f, dest / f.name)
            continue
        try:
            os.link(f, dest / f.name)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            os.symlink(f, dest / f.name)


def _wait_running(client: docker.DockerClient, cid: str, ck: Checkpoint, *, loopback_hook: bool) -> None:
    """Bounded check that the restored container runs (a failed CRIU restore exits it);
    ``loopback_hook``: and that the CRIU hook set its loopback up (``belayer_env.loopback``)."""
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



def _short(e: BaseException) -> str:
    text = str(getattr(e, "explanation", "") or e).strip().splitlines()
    return text[-1][:600] if text else type(e).__name__
