"""Removing a sandbox's containers: now, on a background thread, or waiting for either.

A fenced container is dead and renamed aside already, so nothing waits for its removal:
deleting a big writable layer takes seconds on a discard-mounted disk, and goes on a thread
(``remove_in_background``; ``belayer gc`` reaps what a dying process leaves). Every removal
also removes what containerd kept of the container once Docker has forgotten it
(``ctrd_leftovers.after_removal``), so no removal of a sandbox leaves a shim behind.
"""

from __future__ import annotations

import contextlib
import time

import docker

from belayer_core.errors import SandboxLost
from belayer_env.common.background import ThreadSet
from belayer_env.sandbox import ctrd_leftovers, naming
from belayer_env.sandbox.docker_api import translate_errors

GONE_TIMEOUT_S = 30.0
"""Bound of the wait for a removal Docker reported as already in progress."""

_removing = ThreadSet("belayer-fence-remove")


def remove(client: docker.DockerClient, container_id: str) -> None:
    """Force-remove (kill first) a container; one already gone or being removed is fine.
    What containerd still holds of it once Docker has forgotten it (a task Docker took for
    exited, with its shim: ``ctrd_leftovers``) is removed too."""
    with contextlib.suppress(docker.errors.NotFound):
        try:
            client.api.remove_container(container_id, force=True, v=True)
        except docker.errors.APIError as e:
            if "removal of container" not in str(e) and "already in progress" not in str(e):
                raise
            return  # another removal runs: whoever runs it checks containerd
    ctrd_leftovers.after_removal(client, container_id)


def remove_quietly(client: docker.DockerClient, container_id: str) -> None:
    with contextlib.suppress(Exception):
        remove(client, container_id)


def remove_in_background(client: docker.DockerClient, container_ids: list[str]) -> None:
    """Remove fenced containers on threads: deleting a big writable layer takes seconds,
    and nothing waits for it (they are dead and renamed aside already)."""
    for cid in container_ids:
        _removing.start(remove_quietly, client, cid)


def wait_removed(timeout_s: float = 120.0) -> bool:
    """Wait for this process's background renames (``naming.settle_later``) and removals
    (``env.close``, benchmarks between timed calls); True when none is left. A dying
    process's: ``belayer gc``."""
    naming.settle_all()
    return _removing.wait(timeout_s)


def wait_gone(client: docker.DockerClient, container_id: str, sandbox_name: str) -> None:
    """Bounded wait until Docker no longer lists ``container_id`` (a removal it reported as
    already in progress)."""
    deadline = time.monotonic() + GONE_TIMEOUT_S
    with translate_errors(f"fence sandbox {sandbox_name}"):
        while client.api.containers(all=True, filters={"id": container_id}):
            if time.monotonic() > deadline:
                raise SandboxLost(f"could not fence container {container_id[:12]} of sandbox {sandbox_name}: "
                                  "not removed")
            time.sleep(0.02)
