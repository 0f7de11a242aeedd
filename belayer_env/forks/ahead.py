"""What every fork of a checkpoint needs, verified once: its runtime images and its shared layer.

``fork(ck, n)`` verifies the checkpoint's CRIU images into a directory all forks link to
(``verified_images``) and unpacks its layer as a shared lower layer (``shared_lease.lease``),
then starts the forks; for the heavy benchmark sandbox that is 0.25-0.7 s of a pooled
``fork(ck, 8)`` on 2 cores before the first start (docs/fork.md).

``ForkAhead`` does both as soon as a checkpoint is published, on a thread (while the agent's
LLM generates), and holds them until it is closed: the shared copy leased (``sweep`` keeps
it while no fork uses it) and the images in their own tmpfs. A ``ForkPool`` keeps one, for
the newest checkpoint (``ForkPool.prepare``; ``EnvConfig(fork_pool=n)`` does it for every
published checkpoint): a fork of that checkpoint into the pool then finds the copy ready and
links the images, and only starts containers. The price: the layer unpacked (in memory where
it fits, as for any fork) and the images' pages held in memory per env, and one unpack +
hash of CPU per checkpoint, in the background. Released, the copy is swept at once unless
forks still run on it.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import docker

from belayer_env.common.background import Background
from belayer_env.criu import runtime
from belayer_env.restore import prestaging
from belayer_env.restore.restore import DEFAULT_IMAGES
from belayer_env.store import in_memory, shared_lease, shared_sweep
from belayer_env.store.manifest import Checkpoint, read_manifest_digest
from belayer_env.store.store import owner_tag


def verified_images(checkpoint: Checkpoint, client: docker.DockerClient, data: dict[str, Any]) -> Path:
    """The checkpoint's runtime images copied (hardlinked where the store shares Docker's
    file system) and checked against the manifest, under a name ``clean_dead_staging``
    reaps if we die. With linked images (the default) the copy is a tmpfs of its own where
    it fits (``in_memory.memory_allowed``): a store outside Docker's file system (a bind
    mount here) meant writing every page image onto Docker's disk on each fork, 0.24-0.4 s
    of the heavy fork; the memory is held until the forks run (``discard_images``)."""
    d = prestaging.docker_tmp(client) / f"{prestaging.PREFIX}fork-{uuid.uuid4().hex[:12]}~{owner_tag()}"
    cap = sum(m["size"] for rel, m in data["files"].items() if rel.startswith("runtime/")) + (8 << 20)
    try:
        d.mkdir(mode=0o700, parents=True)
        if DEFAULT_IMAGES == "linked" and in_memory.memory_allowed(cap):
            in_memory.try_mount_tmpfs(d, cap, source=in_memory.FORK, mode="0700")  # the forks symlink to it (staged.link_all)
        runtime.install(Path(checkpoint.path), data["files"], d)
    except BaseException:
        discard_images(d)
        raise
    return d


def discard_images(d: Path) -> None:
    with contextlib.suppress(OSError):
        in_memory.umount(d)
    shutil.rmtree(d, ignore_errors=True)


class ForkAhead:
    """``checkpoint``'s shared layer copy (leased) and verified images, made on a thread now
    and held until ``close``."""

    def __init__(self, checkpoint: Checkpoint, client: docker.DockerClient):
        self.checkpoint = checkpoint
        self._client = client
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False
        self._released = False
        self._job = Background(self._make, checkpoint, client, name="belayer-fork-ahead")

    def _make(self, ck: Checkpoint, client: docker.DockerClient) -> tuple[str, Path | None]:
        data, digest = read_manifest_digest(Path(ck.path))
        shared = self._stack.enter_context(
            shared_lease.lease(client, ck, prestaging.docker_root(client), data, digest))
        images = None
        if ck.has_runtime and not self._closed:
            images = verified_images(ck, client, data)
            self._stack.callback(discard_images, images)
        if shared is not None:
            shared.wait_ready()  # unpacked and verified: what a fork's lease then finds ready
        return digest, images

    def borrow(self, checkpoint: Checkpoint, digest: str) -> Path | None:
        """The verified images when this is ``checkpoint`` (same id and manifest digest),
        waiting for a preparation still running, held until ``give_back``; None when it is
        another checkpoint, failed (the fork then verifies its own) or was closed."""
        if checkpoint.id != self.checkpoint.id:
            return None
        try:
            made_digest, images = self._job.result()
        except Exception:  # noqa: BLE001 - the fork does it itself and reports what fails
            return None
        with self._lock:
            if self._closed or made_digest != digest or images is None:
                return None
            self._users += 1
        return images

    def give_back(self) -> None:
        with self._lock:
            self._users -= 1
        self._release_if_idle()

    def close(self) -> None:
        """Release the copy's lease and remove the images, once no fork uses them (after a
        preparation in flight); the copy goes too unless a fork still runs on it (``sweep``)."""
        with self._lock:
            self._closed = True
        self._job.join()
        self._release_if_idle()

    def _release_if_idle(self) -> None:
        with self._lock:
            if not self._closed or self._users or self._released:  # close() joined the job first
                return
            self._released = True
        self._stack.close()
        with contextlib.suppress(Exception):  # the copy, unused now, is not left holding memory until a gc
            shared_sweep.sweep(self._client, prestaging.docker_root(self._client))
