"""containerd's leftovers of sandbox containers Docker has forgotten: found, and removed.

Why: Docker 20.10 (Debian's docker.io) handles a task-exit event of a container whose
containerd task is in fact still running (seen around CRIU restores) by marking the
container exited and deleting it from containerd, which refuses ("cannot delete running
task ...: failed precondition", dockerd's log). Docker then holds an exited container whose
processes still run, and its later removal never asks containerd again: containerd keeps
the container, its task (running, or STOPPED once something killed it) and the task's
``containerd-shim-runc-v2``, for good. Nothing but containerd knows of them.

Found in the containerd of the local dockerd with ``ctr``, containerd's own client (where that
containerd is, and the bounded ``ctr`` calls: ``containerd.py``). A leftover is a containerd
container that

- dockerd made (its ``com.docker/engine.bundle.path`` label),
- Docker does not know (not in its listing, made after containerd's, and its inspect answers
  NotFound): Docker registers a container before containerd ever sees it, so an id Docker
  does not know is one it is done with,
- and is a Belayer sandbox: its OCI spec runs the sandbox's own init
  (``config.INIT_COMMAND``) with the sandbox's private tmpfs at ``config.OUTPUT_DIR``.
  A container of anyone else is never touched.

``remove`` thaws its cgroup, kills and deletes the task (``ctr tasks delete --force``: kill,
wait for the exit, delete), deletes the container and Docker's bundle directory of it
(``<exec-root>/containerd/<id>``: its stdio FIFOs). ``belayer gc`` sweeps them all;
``after_removal`` checks one container Belayer has just removed through Docker
(``removal.remove``: a restore's failure, a fence; ``DockerSandbox.close``) in two ``stat`` calls and removes what
containerd still holds of it, so no removal of a sandbox leaves a shim behind.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests

from belayer_env.sandbox import freezer
from belayer_env.sandbox.config import INIT_COMMAND, LEGACY_INIT_COMMANDS, OUTPUT_DIR
from belayer_env.sandbox.containerd import (
    CtrError,
    Daemon,
    Unavailable,
    ctr,
    locate,
    not_found,
    tasks,
)

BUNDLE_LABEL = "com.docker/engine.bundle.path"


@dataclass(frozen=True)
class Leftover:
    id: str
    task: str | None
    """containerd's status of its task (RUNNING, STOPPED, PAUSED, ...); None: it has none."""
    pid: int | None
    bundle: str
    """Docker's bundle directory of it (``BUNDLE_LABEL``)."""


@dataclass
class Sweep:
    found: list[Leftover] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Id -> why it could not be removed."""
    unavailable: str | None = None
    """Why containerd could not be looked at (then nothing was found)."""


def sweep(client: docker.DockerClient, *, dry_run: bool = False, ids: list[str] | None = None) -> Sweep:
    """Find (``ids``: among these only) and, unless ``dry_run``, remove Belayer's leftovers in
    the containerd of ``client``'s dockerd. Never raises for containerd being out of reach:
    ``Sweep.unavailable`` says why it could not look."""
    out = Sweep()
    try:
        daemon = locate(client)
        out.found = find(client, daemon, ids=ids)
    except (Unavailable, CtrError) as e:
        out.unavailable = str(e)
        return out
    for lo in [] if dry_run else out.found:
        try:
            remove(daemon, lo)
        except CtrError as e:
            out.failed[lo.id] = str(e)
            continue
        out.removed.append(lo.id)
    return out


def after_removal(client: docker.DockerClient, container_id: str) -> list[str]:
    """Once Docker has removed ``container_id``: remove what containerd still holds of it (the
    ids removed). Two ``stat`` calls when nothing is left (runc's state of the task, Docker's
    bundle directory: both gone once Docker's own clean-up worked); never raises."""
    try:
        daemon = locate(client)
        runc_state = Path(daemon.exec_root) / "runtime-runc" / daemon.namespace / container_id
        bundle = Path(daemon.exec_root) / "containerd" / container_id
        if not runc_state.exists() and not bundle.exists():
            return []
        return sweep(client, ids=[container_id]).removed
    except Exception:  # noqa: BLE001 - a clean-up after a removal (Unavailable included): gc finds what it leaves
        return []


def find(client: docker.DockerClient, daemon: Daemon, *, ids: list[str] | None = None) -> list[Leftover]:
    """The leftovers (module docstring) in ``daemon``'s containerd."""
    try:
        listed = set(ctr(daemon, "containers", "ls", "-q").split())
    except CtrError as e:
        raise Unavailable(f"cannot list containerd's containers at {daemon.address} "
                          f"(namespace {daemon.namespace}): {e}") from e
    if ids is not None:
        listed &= set(ids)
        if not listed:
            return []
    try:  # listed after containerd's: a container made meanwhile is known to Docker by now
        docker_side = client.api.containers(all=True)
    except (docker.errors.APIError, requests.exceptions.RequestException) as e:
        raise Unavailable(f"cannot list Docker's containers: {e}") from e
    known = {c["Id"] for c in docker_side}
    running = {c["Id"] for c in docker_side if c.get("State") == "running"}
    if ids is None and running and not running & listed:
        raise Unavailable(f"containerd at {daemon.address} (namespace {daemon.namespace}) holds none of "
                          "Docker's running containers: not this Docker's containerd")
    unknown = sorted(listed - known)
    if not unknown:
        return []
    listed_tasks = tasks(daemon)
    out = []
    for cid in unknown:
        try:
            info = json.loads(ctr(daemon, "containers", "info", cid))
        except CtrError:
            continue  # gone meanwhile
        except ValueError:
            continue
        if not is_belayer_sandbox(info) or not _unknown_to_docker(client, cid):
            continue
        status, pid = listed_tasks.get(cid, (None, None))
        out.append(Leftover(cid, status, pid, (info.get("Labels") or {}).get(BUNDLE_LABEL, "")))
    return out


def is_belayer_sandbox(info: dict[str, Any]) -> bool:
    """``ctr containers info``'s record of a container dockerd made for a Belayer sandbox:
    the sandbox's init as its process, the sandbox's private tmpfs mounted."""
    if BUNDLE_LABEL not in (info.get("Labels") or {}):
        return False
    spec = info.get("Spec") or {}
    if (spec.get("process") or {}).get("args") not in (INIT_COMMAND, *LEGACY_INIT_COMMANDS):
        return False
    return any(m.get("destination") == OUTPUT_DIR and m.get("type") == "tmpfs" for m in spec.get("mounts") or ())


def remove(daemon: Daemon, lo: Leftover) -> None:
    """Kill and delete its task, delete the container and Docker's bundle directory of it;
    what is gone already is fine. ``CtrError`` when containerd refuses."""
    freezer.thaw(lo.id)  # a frozen cgroup (a capture killed mid-pause) would hold the kill
    try:
        ctr(daemon, "tasks", "delete", "--force", lo.id)  # kill, wait for the exit, delete
    except CtrError as e:
        if not not_found(e):
            raise
    try:
        ctr(daemon, "containers", "delete", lo.id)
    except CtrError as e:
        if not not_found(e):
            raise
    bundle = Path(lo.bundle)
    if bundle.name == lo.id and os.path.realpath(bundle.parent) == os.path.realpath(Path(daemon.exec_root) / "containerd"):
        shutil.rmtree(bundle, ignore_errors=True)


def _unknown_to_docker(client: docker.DockerClient, cid: str) -> bool:
    try:
        client.api.inspect_container(cid)
    except docker.errors.NotFound:
        return True
    except (docker.errors.APIError, requests.exceptions.RequestException):
        return False
    return False


