"""What a checkpoint may ask of its restore: never more than the restoring side allows.

A manifest records the settings its sandbox was created with, and a restore recreates the
container from them. A manifest is data (a store or a replica someone else may write), so
the settings that bound a sandbox (image, network, capabilities, memory, pids, CPUs, disk,
the Docker daemon) are checked against the restoring side's own config (the env's, or the
caller's ``config=``; the secure defaults when none is given): a checkpoint may restore
narrower than that, never wider. A wider one is refused with ``RestoreFailed`` naming the
setting, before anything touches the live sandbox.
"""

from __future__ import annotations

import math
from typing import Any

import docker

from belayer_core.errors import RestoreFailed
from belayer_env.sandbox.config import SandboxConfig, parse_size
from belayer_env.store.manifest import Checkpoint


def _size(value: str | None) -> float:
    return math.inf if value is None else parse_size(value)


def widened(recorded: SandboxConfig, allowed: SandboxConfig) -> list[str]:
    """Each setting of ``recorded`` (a manifest's) that exceeds ``allowed``, in words."""
    out = []
    if recorded.network and not allowed.network:
        out.append("network: the checkpoint has one, the restoring config none")
    extra = sorted(set(recorded.capabilities) - set(allowed.capabilities))
    if extra:
        out.append(f"capabilities: {', '.join(extra)} beyond the restoring config's")
    for field, value, limit in (("memory", _size(recorded.memory), _size(allowed.memory)),
                                ("disk", _size(recorded.disk), _size(allowed.disk)),
                                ("pids_limit", recorded.pids_limit, allowed.pids_limit),
                                ("cpus", recorded.cpus, allowed.cpus)):
        if value > limit:
            out.append(f"{field}: {getattr(recorded, field)} above the restoring config's {getattr(allowed, field)}")
    if recorded.docker_host != allowed.docker_host:
        out.append(f"docker_host: {recorded.docker_host!r}, the restoring config's is {allowed.docker_host!r}")
    return out


def check_image(client: docker.DockerClient, ck: Checkpoint, data: dict[str, Any], allowed: SandboxConfig) -> None:
    """The checkpoint's exact image must be the restoring config's image (by id): a manifest
    cannot choose which local image a sandbox runs."""
    recorded = data.get("image_id") or ck.config.image
    try:
        expected = client.images.get(allowed.image).id
    except docker.errors.ImageNotFound:
        expected = allowed.image
    except docker.errors.APIError as e:
        raise RestoreFailed(f"checkpoint {ck.id}: cannot inspect image {allowed.image!r}: {e.explanation or e}",
                            checkpoint=ck.id) from e
    if recorded not in (expected, allowed.image):
        raise RestoreFailed(f"checkpoint {ck.id} was taken on image {recorded!r}, not on the restoring config's "
                            f"{allowed.image!r} ({expected}): refused (pass config= with that image to allow it)",
                            checkpoint=ck.id)


def check_bounded(client: docker.DockerClient, ck: Checkpoint, data: dict[str, Any],
                  allowed: SandboxConfig | None) -> None:
    """``RestoreFailed`` unless ``ck``'s recorded settings stay within ``allowed``."""
    allowed = allowed if allowed is not None else SandboxConfig()
    wider = widened(ck.config, allowed)
    if wider:
        raise RestoreFailed(f"checkpoint {ck.id} asks for more than the restoring config allows ("
                            + "; ".join(wider) + "): refused (pass config= to allow it)", checkpoint=ck.id)
    check_image(client, ck, data, allowed)
