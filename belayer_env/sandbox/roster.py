"""A sandbox's containers listed ahead and kept valid through the kernel: a rollback's
fence without a Docker call on its critical path.

``Roster.take`` (off the critical path, e.g. once a standby is prepared): the container
cgroups that exist (first), then Docker's listing of the sandbox (``fence.sandbox_containers``).
``Roster.current`` (on the critical path): that listing, plus every container started
since whose own record on Docker's disk (``containers/<id>/config.v2.json``: its name and
labels, written by Docker before a container starts and on every rename) says it is the
sandbox's, plus this process's aliases of it (``naming.add_alias``). None when that cannot be
told (no such cgroup directory, a record unreadable): the caller lists through Docker.

Why it is complete: every running container has a cgroup of its own, made when it starts.
A container of the sandbox that started after the snapshot is new there and is read from
its record; one that started before is in the listing, by its label (fixed at creation) or
the name it held. A container takes a sandbox's name after creation only through a rename,
which Belayer does to a container it just restored (new since the snapshot) or to a
promoted standby (an alias until renamed). Exited, created and fenced containers are in the
listing as Docker had them; what a rollback needs of them (their names freed) follows off
the critical path.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker

from belayer_env.sandbox import fence, naming
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.ownership import SANDBOX_NAME

_ID = re.compile(r"^(?:docker-)?([0-9a-f]{64})(?:\.scope)?$")
_ROOTS: dict[int, str] = {}


def running_ids(cgroup_dir: Path) -> set[str] | None:
    """Ids of the containers that have a cgroup in ``cgroup_dir`` (Docker's parent cgroup)."""
    try:
        return {m.group(1) for name in os.listdir(cgroup_dir) if (m := _ID.match(name))}
    except OSError:
        return None


@dataclass
class Roster:
    name: str
    cgroup_dir: Path
    docker_root: Path
    started: set[str]
    listed: list[dict[str, Any]]

    @classmethod
    def take(cls, client: docker.DockerClient, name: str, cgroup_dir: Path) -> Roster | None:
        """Snapshot then list (this order: a container started in between counts as new)."""
        started = running_ids(cgroup_dir)
        if started is None:
            return None
        key = id(client)
        if key not in _ROOTS:
            with translate_errors("docker info"):
                _ROOTS[key] = client.info()["DockerRootDir"]
        listed = fence.sandbox_containers(client, name, by_name=True)
        return cls(name, cgroup_dir, Path(_ROOTS[key]), started, listed)

    def current(self, name: str, skip: str) -> list[dict[str, Any]] | None:
        """The sandbox's containers now (``skip``: one known to be no victim), or None."""
        if name != self.name:
            return None
        now = running_ids(self.cgroup_dir)
        if now is None:
            return None
        found = {c["Id"]: c for c in self.listed if c["Id"] != skip}
        for cid in (now - self.started) | naming.aliases(name):
            if cid == skip or cid in found:
                continue
            record = self._record(cid)
            if record is None:
                if any((self.cgroup_dir / d).exists() for d in (cid, f"docker-{cid}.scope")):
                    return None  # running, and Docker's record of it unreadable: cannot tell
                continue  # removed meanwhile, cgroup and all
            labels = (record.get("Config") or {}).get("Labels") or {}
            if labels.get(SANDBOX_NAME) == name or record.get("Name") == f"/{name}":
                found[cid] = {"Id": cid, "Names": [record.get("Name", "")], "State": "running",
                              "Labels": labels}
        return [found[k] for k in sorted(found)]

    def _record(self, cid: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.docker_root / "containers" / cid / "config.v2.json").read_bytes())
        except (OSError, ValueError):
            return None
