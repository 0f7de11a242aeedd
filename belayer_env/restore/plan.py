"""What a restore goes from and into, decided before anything touches the sandbox.

``full_restore``'s arguments are one ``RestoreRequest``; ``plan`` checks it (its usage, the
manifest, the runtime state, the CRIU loopback hook, the restoring side's bounds:
``trust.check_bounded``) and decides for the doing (``restore.py``):

- *from*: a copy pre-staged against exactly this manifest (``prestaging.claim``: layer and
  images unpacked and verified ahead of time; for a disk-capped sandbox, its layer's whole
  file system), else the checkpoint unpacked now, layer and images side by side on two
  threads, each checked against the manifest (``staged.Staged``, started here); a fork's
  images verified once for all forks (``verified_images``) and its layer a shared lower
  layer (``shared``), not unpacked here at all;
- *into*: a pooled container (``precreated``: a fork pool's), the restore spare (``spare``:
  used when the checkpoint was taken of a container made like it), or one created then;
- *how the images reach CRIU*: ``linked`` or ``copied`` (``images``; ``restore.py``'s docstring).
"""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import docker

from belayer_core.errors import RestoreFailed, UsageError
from belayer_env.common.phases import Phase, PhaseHook, no_hook
from belayer_env.host import loopback
from belayer_env.restore import prestaging
from belayer_env.restore.spare import RestoreSpare, Slot
from belayer_env.restore.staged import Staged, install_images, unpack_layer
from belayer_env.restore.trust import check_bounded
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.docker_api import connect
from belayer_env.store import shared_layer
from belayer_env.store.manifest import Checkpoint, read_manifest_digest

Images = Literal["linked", "copied"]
DEFAULT_IMAGES: str = os.environ.get("BELAYER_RESTORE_IMAGES", "linked")
"""Chosen by measurement (benchmarks/restore_bench.py, docs/restore.md)."""


@dataclass(frozen=True)
class RestoreRequest:
    """``full_restore``'s arguments (its docstring says what each one means)."""

    checkpoint: Checkpoint
    allow_degraded: bool = False
    client: docker.DockerClient | None = None
    phase_hook: PhaseHook | None = None
    name: str | None = None
    use_staged: bool = True
    images: Images | None = None
    shared: shared_layer.SharedLower | None = None
    verified_images: Path | concurrent.futures.Future[Path] | None = None
    fence_first: bool = True
    precreated: Slot | None = None
    spare: RestoreSpare | None = None
    config: SandboxConfig | None = None


@dataclass(frozen=True)
class RestorePlan:
    """A checked request and what it restores from: ``staged`` (a claimed pre-staged copy)
    or the unpacks under way (``layer``, ``images``); ``layer_image``: the pre-staged file
    system of a disk-capped layer, mounted instead of filled."""

    request: RestoreRequest
    data: dict[str, Any]
    """The manifest."""
    client: docker.DockerClient
    target: str
    """The sandbox name the restored container takes."""
    via: str
    """How the images reach CRIU (one of ``Images``)."""
    hook: PhaseHook
    tmp: Path
    """Docker's tmp dir (the file system of the containers' upperdirs)."""
    staged: Path | None
    layer_image: Path | None
    layer: Staged | None
    images: Staged | None

    @property
    def ck(self) -> Checkpoint:
        return self.request.checkpoint


def plan(request: RestoreRequest) -> RestorePlan:
    """Check ``request`` and choose what it restores from; nothing of the sandbox of that
    name is touched here (``UsageError`` for a bad request, ``RestoreFailed`` naming the
    checkpoint otherwise). The unpacks it chooses start here, on threads of their own."""
    r, ck = request, request.checkpoint
    via = r.images or DEFAULT_IMAGES
    if via not in get_args(Images):
        raise UsageError(f"images must be one of {get_args(Images)}, got {via!r} (BELAYER_RESTORE_IMAGES?)")
    target = r.name or ck.sandbox
    if r.precreated is not None and (r.shared is None or r.precreated.target != target or not r.precreated.alias):
        raise UsageError("a pooled container serves a shared fork, under the name it was created for")
    if r.spare is not None and r.shared is not None:
        raise UsageError("a restore spare serves a restore with a layer of its own, not a shared fork")
    try:
        data, digest = read_manifest_digest(Path(ck.path))
    except ValueError as e:
        raise RestoreFailed(f"checkpoint {ck.id} is incomplete: {e}", checkpoint=ck.id) from e
    if not ck.has_runtime and not r.allow_degraded:
        raise RestoreFailed(f"checkpoint {ck.id} holds no runtime state; a file-system-only restore "
                            "needs allow_degraded=True", checkpoint=ck.id)
    if data.get("network_disabled") and not loopback.installed():  # before anything touches the sandbox
        raise RestoreFailed(f"checkpoint {ck.id} was taken of a sandbox without Docker's network stack and "
                            f"this host lacks the CRIU loopback hook that restores need ({loopback.HOOK_PATH} "
                            f"listed in {loopback.RUNC_CRIU_CONF}): run `bash scripts/setup.sh`", checkpoint=ck.id)
    client = r.client or connect((r.config or SandboxConfig()).docker_host)  # never the manifest's daemon
    check_bounded(client, ck, data, r.config)
    tmp = prestaging.docker_tmp(client)
    prestaging.clean_dead_staging(tmp)
    staged = prestaging.claim(client, ck, digest) if ck.has_runtime and r.use_staged and r.shared is None else None
    hook = r.phase_hook or no_hook
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
        fs = None if r.shared is not None else Staged(ck, "file-system layer", tmp, lambda d: unpack_layer(ck, data, d))
        runtime_images = (None if not ck.has_runtime else
                          Staged.borrowed(ck, "runtime images", r.verified_images) if r.verified_images is not None else
                          Staged(ck, "runtime images", tmp, lambda d: install_images(ck, data, d)))
    return RestorePlan(request, data, client, target, via, hook, tmp, staged, layer_image, fs, runtime_images)
