"""Find and remove sandbox containers whose owning process is gone, end the helper
processes of dumps whose checkpointer is gone (``dump_helpers``), and remove what containerd
still holds of sandbox containers Docker has forgotten (``containerd_leftovers``).

A container can be wedged: left paused (its freezer cgroup FROZEN) by a capture whose
process died, sometimes with a ``runc init`` stuck so that Docker's own calls on it hang.
``remove_all`` thaws such a container through its cgroup first (no Docker call needed),
then asks Docker (every call bounded by the client's timeout) to unpause and remove it,
and reports a container it still cannot remove, with the reason, instead of failing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import docker
import docker.errors
import requests

from belayer_env.criu import helpers
from belayer_env.sandbox import ctrd_leftovers, freezer
from belayer_env.sandbox.config import MANAGED_LABEL
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.ownership import OWNER_HOST, OWNER_PID, SANDBOX_NAME, owner_alive


@dataclass(frozen=True)
class ManagedContainer:
    id: str
    name: str
    status: str
    sandbox: str
    owner: str
    orphaned: bool


def list_managed(client: docker.DockerClient) -> list[ManagedContainer]:
    with translate_errors("list sandbox containers"):
        containers = client.api.containers(all=True, filters={"label": f"{MANAGED_LABEL}=1"})
    out = []
    for c in containers:
        labels = c.get("Labels") or {}
        out.append(ManagedContainer(
            id=c["Id"],
            name=(c.get("Names") or ["?"])[0].lstrip("/"),
            status=c.get("State", "?"),
            sandbox=labels.get(SANDBOX_NAME, ""),
            owner=f"{labels.get(OWNER_HOST, '?')}:{labels.get(OWNER_PID, '?')}",
            orphaned=not owner_alive(labels),
        ))
    return out


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)
    """Ids removed (or already gone)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Id -> why it could not be removed."""


def remove_all(client: docker.DockerClient, containers: list[ManagedContainer]) -> GcReport:
    """Thaw and force-remove each of ``containers``; one failure stops nothing."""
    report = GcReport()
    for c in containers:
        try:
            # a freezer can be FROZEN while Docker says "running" (a capture killed mid-pause):
            # thaw through the cgroup first, always; Docker's unpause only where it knows
            freezer.thaw(c.id)
            if c.status == "paused":
                with contextlib.suppress(docker.errors.APIError):
                    client.api.unpause(c.id)  # so that Docker's state agrees (bounded by the client's timeout)
            client.api.remove_container(c.id, force=True, v=True)
        except docker.errors.NotFound:
            pass  # gone already: what gc wanted
        except docker.errors.APIError as e:
            why = str(e.explanation or e)
            if "already in progress" not in why:
                report.failed[c.id] = why.strip()[-400:]
                continue
        except (requests.exceptions.RequestException, OSError) as e:
            report.failed[c.id] = f"Docker did not answer ({type(e).__name__}: {str(e)[-200:]})"
            continue
        report.removed.append(c.id)
    return report


def reap(client: docker.DockerClient, containers: list[ManagedContainer]) -> list[str]:
    """Force-remove ``containers``; return the ids removed (``remove_all`` also says why not)."""
    return remove_all(client, containers).removed


def containerd_leftovers(client: docker.DockerClient, *, dry_run: bool = False) -> ctrd_leftovers.Sweep:
    """What containerd still holds of sandbox containers Docker has forgotten (a task, often
    still running, its shim, the container: ``sandbox/ctrd_leftovers.py``), removed (``dry_run``:
    listed). ``Sweep.unavailable`` says why containerd could not be looked at (no ``ctr``, a
    remote Docker)."""
    return ctrd_leftovers.sweep(client, dry_run=dry_run)


def dump_helpers() -> list[helpers.Helper]:
    """The processes of dumps whose checkpointer is gone (runc, CRIU, their action scripts, an
    orphan-thaw watcher), found by the marker every dump gives them (``criu/helpers.py``)."""
    return helpers.orphans()


def end_dump_helpers(found: list[helpers.Helper]) -> list[int]:
    """End ``found`` (by pidfd) and thaw the cgroups their dumps had frozen; the pids ended."""
    return helpers.end(found)


def sweep_shared_layers(client: docker.DockerClient, *, dry_run: bool = False) -> list[str]:
    """Remove the shared layers of forks (``store/shared_layer.py``) that no container
    uses and no fork is being made from; the names removed (``dry_run``: that it would
    remove now). Also what dead processes left in Docker's tmp dir
    (``prestaging.clean_dead_staging``: a fork's in-memory images are a tmpfs there, held
    until the next restore otherwise)."""
    from belayer_env.restore import prestaging
    from belayer_env.store import shared_sweep

    if not dry_run:
        prestaging.clean_dead_staging(prestaging.docker_tmp(client))
    return shared_sweep.sweep(client, prestaging.docker_root(client), dry_run=dry_run)
