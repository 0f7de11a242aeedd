"""Fencing a sandbox: once ``fence`` returns, no container of that sandbox name runs.

The one place that finds a sandbox's containers (``sandbox_containers``: by the
``belayer.sandbox`` label and by name) and kills them. Recovery fences before it
restores, because the old container may still be running the interrupted action;
``full_restore`` fences the name it is about to reuse; ``env.close`` fences to clean up.

A container left paused (a capture that died mid-freeze) is thawed first: Docker's
unpause, bounded by ``UNPAUSE_TIMEOUT_S``, then the freezer cgroup directly when Docker
does not answer (an exec that raced the pause wedges Docker's view of the container) or
when its view is stale (cgroup frozen, Docker says running). So a paused container never
outlives the fence.

The dead containers' removal is ``removal.py``'s (on a thread by default); Docker's names
of a sandbox set later, off a rollback's critical path, are ``naming.py``'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import uuid
from typing import Any

import docker
import requests

from belayer_core.errors import SandboxLost
from belayer_env.sandbox import freezer, naming
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.ownership import SANDBOX_NAME
from belayer_env.sandbox.removal import remove, remove_in_background, wait_gone

UNPAUSE_TIMEOUT_S = 5.0
STOPPED_TIMEOUT_S = 30.0
KERNEL_KILL_WAIT_S = 5.0
"""Processes still in the cgroup this long after the SIGKILL (e.g. held ptrace-stopped by a hung
CRIU): Docker's kill and wait (``STOPPED_TIMEOUT_S``) take over."""


_listers = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="belayer-fence-list")
"""Threads kept for the by-name listing beside the by-label one (a thread started per
listing waits for the CPU on a busy host)."""


def sandbox_containers(client: docker.DockerClient, sandbox_name: str, *,
                       by_name: bool = False) -> list[dict[str, Any]]:
    """Docker's list entries (``Id``, ``State``, ...) of every container of the sandbox.

    By label; ``by_name`` also finds a container that merely holds the name (not one of
    ours, but in the way of reusing it). Listing never blocks on a wedged container.
    Docker's names of the sandbox still being set on a thread (``naming.settle_later``: a
    promoted standby's renames) are set first.
    """
    naming.settled(sandbox_name)
    with translate_errors(f"list containers of sandbox {sandbox_name}"):
        # the two listings side by side: a rollback lists up to three times on its critical path
        named = (_listers.submit(client.api.containers, all=True, filters={"name": f"^/{sandbox_name}$"})
                 if by_name else None)
        found = {c["Id"]: c for c in client.api.containers(
            all=True, filters={"label": f"{SANDBOX_NAME}={sandbox_name}"})}
        if named is not None:
            for c in named.result():
                found.setdefault(c["Id"], c)
        for cid in naming.aliases(sandbox_name) - set(found):
            for c in client.api.containers(all=True, filters={"id": cid}):
                found.setdefault(c["Id"], c)
    return [found[k] for k in sorted(found)]


def fence(client: docker.DockerClient, sandbox_name: str, *, background: bool = True) -> list[str]:
    """Kill every container of ``sandbox_name`` (by label and name) and free the name.

    Once this returns, none of them runs and the name is free. ``background=False``
    removes them before returning. By default they are killed, renamed aside and removed
    on a background thread (removing a big writable layer takes seconds on a
    discard-mounted disk; ``belayer gc`` reaps any that a dying process leaves behind).
    Returns the ids of the containers fenced.
    """
    if background:
        killed = kill(client, sandbox_name)
        remove_in_background(client, killed)
        return killed
    found = sandbox_containers(client, sandbox_name, by_name=True)
    for c in found:
        thaw(client, c["Id"], paused=c.get("State") == "paused")
    for c in found:
        remove(client, c["Id"])
    for c in found:
        wait_gone(client, c["Id"], sandbox_name)
    return [c["Id"] for c in found]


def kill(client: docker.DockerClient, sandbox_name: str, *, docker_view: bool = True) -> list[str]:
    """``fence`` without the removal: kill every container of the sandbox and rename it
    aside (the name is free); returns the ids left to ``remove_in_background``.
    ``docker_view``: as for ``kill_listed``."""
    return kill_listed(client, sandbox_name, sandbox_containers(client, sandbox_name, by_name=True),
                       docker_view=docker_view)


def kill_listed(client: docker.DockerClient, sandbox_name: str, found: list[dict[str, Any]], *,
                docker_view: bool = True) -> list[str]:
    """``kill`` of the containers ``sandbox_containers`` listed (a restore lists them, then
    creates the new container while these die). ``docker_view=False``: return once no
    process of theirs is left (the kernel's view), before Docker's state says so (~150 ms
    later); the caller then calls ``wait_not_running`` (a restore: after its start)."""
    aside = [c["Id"] for c in found if fenced_already(c, sandbox_name)]
    found = [c for c in found if c["Id"] not in aside]
    for c in found:
        thaw(client, c["Id"], paused=c.get("State") == "paused")
    killed = [c["Id"] for c in found if _kill_and_rename(client, c["Id"], sandbox_name, docker_view)]
    if docker_view and aside:  # after the kills: a live container is never kept waiting for this
        wait_not_running(client, aside, sandbox_name)
    return aside + killed


def fenced_already(listed: dict[str, Any], sandbox_name: str) -> bool:
    """Renamed aside by an earlier fence and dead (in Docker's listing, or no process left in
    its cgroup: Docker's state lags the kernel's by 50-150 ms): nothing left to do but the
    removal. With ``docker_view=False`` this spares an inspect that Docker holds until it
    has processed the container's exit (~50 ms) on a rollback's critical path. Still
    returned by ``kill_listed``: whoever fences the name again also removes it."""
    if not any(n.startswith(f"/{sandbox_name}-fenced-") for n in listed.get("Names") or ()):
        return False
    return listed.get("State") in ("exited", "dead", "created") or freezer.no_process_left(listed["Id"])


def wait_not_running(client: docker.DockerClient, container_ids: list[str], sandbox_name: str) -> None:
    """Bounded wait until Docker's state no longer says running for any of ``container_ids``
    (killed already); one removed meanwhile (e.g. by a concurrent fence) is fenced all the same."""
    deadline = time.monotonic() + STOPPED_TIMEOUT_S
    with translate_errors(f"fence sandbox {sandbox_name}"):
        for cid in container_ids:
            try:
                while client.api.inspect_container(cid)["State"].get("Running"):
                    if time.monotonic() > deadline:
                        raise SandboxLost(f"could not fence container {cid[:12]} of sandbox {sandbox_name}: "
                                          f"Docker still says running after {STOPPED_TIMEOUT_S:g} s")
                    time.sleep(0.01)
            except docker.errors.NotFound:
                continue


def kill_kernel(client: docker.DockerClient, sandbox_name: str, found: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The kill of ``kill_listed`` through the kernel alone, for a rollback's critical path
    where the daemon is known to be local (a container of it has its cgroup here): no
    inspect, no rename, no Docker kill; a container without a cgroup has no process. Returns (killed: dead in the kernel's view, still
    to be renamed aside, ``rename_aside``; done: renamed aside already, dead). A container
    whose cgroup cannot be read here, or does not empty, goes Docker's way (``kill_listed``)."""
    killed, done = [], []
    for c in found:
        if fenced_already(c, sandbox_name):
            done.append(c["Id"])
        elif c.get("State") != "paused" and freezer.kill_cgroup(c["Id"], KERNEL_KILL_WAIT_S, local=True):
            killed.append(c["Id"])
        else:
            done += kill_listed(client, sandbox_name, [c], docker_view=False)
    return killed, done


def rename_aside(client: docker.DockerClient, container_id: str, sandbox_name: str) -> None:
    """Free the sandbox's name held by a dead container (one already gone is fine; one that
    cannot be renamed is removed now)."""
    with translate_errors(f"fence sandbox {sandbox_name}"):
        try:
            client.api.rename(container_id, f"{sandbox_name}-fenced-{uuid.uuid4().hex[:8]}")
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError:
            remove(client, container_id)


def thaw(client: docker.DockerClient, container_id: str, *, paused: bool) -> None:
    """Unfreeze a container (``paused``: Docker's view). Docker's unpause first, bounded;
    the freezer cgroup directly when that does not answer or Docker's view is stale."""
    if paused:
        with contextlib.suppress(docker.errors.APIError, requests.exceptions.RequestException):
            api = client.api
            res = api._post(api._url("/containers/{0}/unpause", container_id), timeout=UNPAUSE_TIMEOUT_S)
            api._raise_for_status(res)
    if freezer.is_frozen(container_id) and not freezer.thaw(container_id):
        raise SandboxLost(f"container {container_id[:12]} stays frozen: its freezer cgroup cannot be thawed")


def _kill_and_rename(client: docker.DockerClient, cid: str, sandbox_name: str, docker_view: bool = True) -> bool:
    """SIGKILL and rename aside; False if already gone. Dead: no process left in the
    container's cgroup (``freezer.kill_all``) and, with ``docker_view``, Docker's state
    no longer running (without the cgroup: Docker's view after Docker's kill)."""
    with translate_errors(f"fence sandbox {sandbox_name}"):
        try:
            info = client.api.inspect_container(cid)
            dead = False
            if info["State"].get("Running"):
                # the kernel's kill (~10 ms) rather than Docker's (~200 ms: it waits for its
                # own bookkeeping); Docker's when the cgroup cannot be read here
                dead = freezer.kill_all(cid, info["State"].get("Pid", 0), KERNEL_KILL_WAIT_S)
                if not dead:
                    client.api.kill(cid)
            if not info["Name"].lstrip("/").startswith(f"{sandbox_name}-fenced-"):
                client.api.rename(cid, f"{sandbox_name}-fenced-{uuid.uuid4().hex[:8]}")
            if dead and not docker_view:
                return True  # no process left in its cgroup; Docker's state catches up on its own
        except docker.errors.NotFound:
            return False
        except docker.errors.APIError:
            remove(client, cid)  # could not kill/rename: remove it here and now
            return False
    wait_not_running(client, [cid], sandbox_name)
    return True
