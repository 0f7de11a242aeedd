"""Docker's own checkpoint and restore, the baseline the capture and restore benchmarks
measure Belayer against (the naive way): pause -> ``POST /containers/{id}/checkpoints``
(leave running) -> ``docker commit --pause=false`` -> unpause; restore = create from the
commit, copy the checkpoint in, ``start?checkpoint=``."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

from belayer_env.restore.ctrd_copies import remove as remove_ctrd_copy
from belayer_env.restore.ctrd_copies import write_nonce
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.create import create_container


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def docker_checkpoint(client, sb: DockerSandbox, name: str) -> dict:
    api, cid = client.api, sb.container_id
    t0 = time.monotonic()
    api.pause(cid)
    res = api.post(api._url("/containers/{0}/checkpoints", cid), data=json.dumps({"CheckpointID": name, "Exit": False}),
                   headers={"Content-Type": "application/json"})
    api._raise_for_status(res)
    image = api.commit(cid, repository="belayer-bench", tag=name, pause=False)["Id"]
    api.unpause(cid)
    frozen = time.monotonic() - t0
    ckdir = Path(client.info()["DockerRootDir"]) / "containers" / cid / "checkpoints" / name
    layer = client.api.inspect_image(image)["Size"] - client.api.inspect_image(sb.config.image)["Size"]
    return {"frozen_s": frozen, "total_s": frozen, "size_bytes": dir_size(ckdir) + max(layer, 0),
            "image": image, "ckdir": ckdir}


def docker_restore(client, sb: DockerSandbox, ck: dict, name: str) -> float:
    t0 = time.monotonic()
    config = sb.config.model_copy(update={"image": ck["image"]})
    c = create_container(client, config, f"{sb.name}-dk-{name}")
    dest = Path(client.info()["DockerRootDir"]) / "containers" / c.id / "checkpoints" / name
    shutil.copytree(ck["ckdir"], dest)
    nonce = write_nonce(dest)  # a unique digest in containerd's store; names its unpacked copy
    api = client.api
    try:
        api._raise_for_status(api.post(api._url("/containers/{0}/start", c.id), params={"checkpoint": name}))
        return time.monotonic() - t0
    finally:
        api.remove_container(c.id, force=True)
        remove_ctrd_copy(nonce)  # containerd never removes it


def delete_docker_checkpoint(client, cid: str, name: str) -> None:
    api = client.api
    with contextlib.suppress(Exception):  # best effort: it goes with the container anyway
        api._raise_for_status(api.delete(api._url("/containers/{0}/checkpoints/{1}", cid, name)))


def remove_images(client, images: list[str]) -> None:
    """The commits' images, removed after the timed part (removal is slow under load)."""
    for image in images:
        try:
            client.api.remove_image(image, force=True)
        except Exception as e:  # noqa: BLE001 - best effort cleanup
            print(f"  (could not remove {image[:19]}: {e})")
