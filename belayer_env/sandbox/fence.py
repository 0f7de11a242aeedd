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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
import uuid
from typing import Any

import docker
import requests

from belayer_core.errors import SandboxLost
from belayer_env.common.background import ThreadSet
from belayer_env.sandbox import ctrd_leftovers, freezer
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.ownership import SANDBOX_NAME

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
    Docker's names of the sandbox still being set on a thread (``settle_later``: a promoted
    standby's renames) are set first.
    """
    _settled(sandbox_name)
    with translate_errors(f"list containers of sandbox {sandbox_name}"):
        # the two listings side by side: a rollback lists up to three times on its critical path
        named = (_listers.submit(client.api.containers, all=True, filters={"name": f"^/{sandbox_name}$"})
                 if by_name else None)
        found = {c["Id"]: c for c in client.api.containers(
            all=True, filters={"label": f"{SANDBOX_NAME}={sandbox_name}"})}
        if named is not None:
            for c in named.result():
                found.setdefault(c["Id"], c)
        for cid in aliases(sandbox_name) - set(found):
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
        _wait_gone(client, c["Id"], sandbox_name)
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


_removing = ThreadSet("belayer-fence-remove")


def remove_in_background(client: docker.DockerClient, container_ids: list[str]) -> None:
    """Remove fenced containers on threads: deleting a big writable layer takes seconds,
    and nothing waits for it (they are dead and renamed aside already)."""
    for cid in container_ids:
        _removing.start(remove_quietly, client, cid)


def wait_removed(timeout_s: float = 120.0) -> bool:
    """Wait for this process's background renames (``settle_later``) and removals
    (``env.close``, benchmarks between timed calls); True when none is left. A dying
    process's: ``belayer gc``."""
    with _pending_lock:
        names = list(_pending)
    for name in names:
        _settled(name)
    return _removing.wait(timeout_s)


_pending: dict[str, threading.Event] = {}
_pending_lock = threading.Lock()
_aliases: dict[str, set[str]] = {}


def add_alias(sandbox_name: str, container_id: str) -> None:
    """Count ``container_id`` as a container of ``sandbox_name`` in this process's listings
    before Docker names it so (a standby being promoted: its rename follows on a thread)."""
    with _pending_lock:
        _aliases.setdefault(sandbox_name, set()).add(container_id)


def drop_alias(sandbox_name: str, container_id: str) -> None:
    with _pending_lock:
        ids = _aliases.get(sandbox_name, set())
        ids.discard(container_id)
        if not ids:
            _aliases.pop(sandbox_name, None)


def aliases(sandbox_name: str) -> set[str]:
    with _pending_lock:
        return set(_aliases.get(sandbox_name, ()))


def settle_later(sandbox_name: str, fn: Any, *args: Any) -> threading.Event:
    """Run ``fn(*args)``, Docker's bookkeeping of sandbox ``sandbox_name`` (renames), on this
    module's worker thread, off a rollback's critical path (queued, not started: a thread
    start would wait for the CPU on a busy host). Every later listing of that sandbox in
    this process (``sandbox_containers``: a fence, a restore, ``env.close``) waits for it
    first, so none acts on names it has not set yet. ``fn`` must not list that sandbox
    itself. Returns the job's end (set once it ran, whatever its outcome)."""
    done = threading.Event()
    with _pending_lock:
        _pending[sandbox_name] = done
    _jobs.put((fn, args, done))
    start_worker()
    return done


_jobs: queue.SimpleQueue = queue.SimpleQueue()
_worker: threading.Thread | None = None


def start_worker() -> None:
    """Start the worker once per process (a ``Standby`` does at its creation, not on a rollback)."""
    global _worker
    with _pending_lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, daemon=True, name="belayer-fence-names")
            _worker.start()


def _work() -> None:
    while True:
        fn, args, done = _jobs.get()
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001, S110 - the job cleans up after itself
            pass
        finally:
            done.set()


def _settled(sandbox_name: str) -> None:
    with _pending_lock:
        done = _pending.get(sandbox_name)
    if done is None:
        return
    done.wait()  # FIFO: every earlier job of that name has run too
    with _pending_lock:
        if _pending.get(sandbox_name) is done:
            del _pending[sandbox_name]


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


def _wait_gone(client: docker.DockerClient, cid: str, sandbox_name: str) -> None:
    """Bounded wait for a removal Docker reported as already in progress."""
    deadline = time.monotonic() + STOPPED_TIMEOUT_S
    with translate_errors(f"fence sandbox {sandbox_name}"):
        while client.api.containers(all=True, filters={"id": cid}):
            if time.monotonic() > deadline:
                raise SandboxLost(f"could not fence container {cid[:12]} of sandbox {sandbox_name}: not removed")
            time.sleep(0.02)


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
