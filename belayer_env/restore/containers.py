"""The container a restore goes into: one created then with the checkpoint's settings and
exact image (``create``), a fork pool's (``attach_precreated``) or the restore spare
(``fit_spare``); and the fence of the sandbox's old containers, run beside it
(``fence_all_but``). Each removes the container it was given if it fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import docker

from belayer_env.restore.spare import Slot
from belayer_env.sandbox import disk, fence
from belayer_env.sandbox.create import create_container
from belayer_env.sandbox.ownership import SANDBOX_NAME
from belayer_env.sandbox.removal import remove_quietly
from belayer_env.store import shared_layer
from belayer_env.store.manifest import Checkpoint


def create(client: docker.DockerClient, ck: Checkpoint, data: dict[str, Any], name: str, sandbox: str,
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


def attach_precreated(client: docker.DockerClient, slot: Slot, shared: shared_layer.SharedLower) -> None:
    """A pooled container onto the shared layer: its alias names the copy, then its lowers."""
    try:
        shared_layer.make_alias(shared, slot.alias)
        shared.attach(slot.inspect)
    except BaseException:
        remove_quietly(client, slot.container_id)
        raise


def fit_spare(client: docker.DockerClient, slot: Slot, ck: Checkpoint, layer_image: Path | None) -> None:
    """A spare (created without a disk cap) gets what ``create`` gives a new container:
    the pre-staged layer file system mounted as its layer, or else the checkpoint's cap."""
    try:
        if layer_image is not None:
            disk.mount_layer_image(slot.inspect, layer_image)
        elif ck.config.disk_bytes is not None:
            disk.limit_layer(slot.inspect, ck.config.disk_bytes)
    except BaseException:
        remove_quietly(client, slot.container_id)
        raise


def fence_all_but(client: docker.DockerClient, target: str, new_name: str) -> list[str]:
    """Kill every container of sandbox ``target`` except this restore's own (``new_name``)."""
    listed = [c for c in fence.sandbox_containers(client, target, by_name=True)
              if f"/{new_name}" not in (c.get("Names") or ())]
    return fence.kill_listed(client, target, listed, docker_view=False)  # dead is enough to start; Docker's view: after the start


def fence_nothing(*_args: Any) -> list[str]:
    """``fence_all_but`` where no container can hold the name (``fence_first=False``)."""
    return []
