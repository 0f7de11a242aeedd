"""Find and remove sandbox containers whose owning process is gone."""

from __future__ import annotations

from dataclasses import dataclass

import docker

from belayer_env.config import MANAGED_LABEL
from belayer_env.docker_api import translate_errors
from belayer_env.ownership import OWNER_HOST, OWNER_PID, SANDBOX_NAME, owner_alive


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


def reap(client: docker.DockerClient, containers: list[ManagedContainer]) -> list[str]:
    """Force-remove ``containers``; return the ids removed (ones already gone are skipped)."""
    removed = []
    for c in containers:
        try:
            with translate_errors(f"remove container {c.name}"):
                client.api.remove_container(c.id, force=True, v=True)
        except Exception as e:  # already gone or being removed concurrently: not an error for gc
            if "no such container" in str(e).lower() or "already in progress" in str(e):
                continue
            raise
        removed.append(c.id)
    return removed
