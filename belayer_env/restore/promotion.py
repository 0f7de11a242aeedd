"""A standby's promotion (``Standby.promote``): replace sandbox ``name`` by the frozen standby.

Through the kernel (``promote_kernel``) where the standby's freezer cgroup is readable here:
fence (SIGKILL each listed container's init, dead once its cgroup is empty), thaw, verify,
and Docker's names after the critical path (``naming.settle_later``). Else through Docker
(``promote_docker``): its unpause beside the fence. Either way a failure fences the standby
under both names: nothing half-promoted runs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import docker

from belayer_core.errors import SandboxLost
from belayer_env.common.background import Background
from belayer_env.common.phases import Phase, PhaseHook
from belayer_env.sandbox import fence, freezer, naming, removal
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.sandbox.roster import Roster
from belayer_env.store.manifest import Checkpoint


@dataclass(frozen=True)
class Frozen:
    """A prepared standby as checked while preparing: frozen through ``control`` (its
    freezer file), Docker's view running with init ``pid``; ``roster``: its sandbox's
    containers as listed then, kept valid through the kernel (``sandbox/roster.py``)."""

    container_id: str
    pid: int
    control: Path
    roster: Roster | None = None


def promote_kernel(client: docker.DockerClient, hook: PhaseHook, checkpoint: Checkpoint, name: str, standby: str,
                   frozen: Frozen, phases: dict[str, float]) -> DockerSandbox:
    """Fence + thaw + verify through the kernel; Docker's names on a thread. ``phases``
    gets the seconds of each (``Standby.last_promote``)."""
    cid = frozen.container_id
    t0 = time.perf_counter()
    try:
        found = frozen.roster.current(name, cid) if frozen.roster is not None else None
        phases["listed_ahead"] = float(found is not None)
        if found is None:
            found = [c for c in fence.sandbox_containers(client, name, by_name=True) if c["Id"] != cid]
        killed, done = fence.kill_kernel(client, name, found)
        t1 = time.perf_counter()
        phases["fence_s"] = t1 - t0
        naming.add_alias(name, cid)  # a container of ``name`` from here on, in every listing of it
        if not freezer.thaw(cid):
            raise SandboxLost(f"standby {standby} could not be thawed")
        t2 = time.perf_counter()
        phases["thaw_s"] = t2 - t1
        hook(Phase.STANDBY_THAWED)
        t2 = time.perf_counter()
        if not freezer.init_alive(cid, frozen.pid):
            raise SandboxLost(f"thawed standby of {checkpoint.id}: container {cid[:12]} lost its init process")
        phases["verify_s"] = time.perf_counter() - t2
    except BaseException:
        with contextlib.suppress(Exception):  # under either name: nothing half-promoted runs
            fence.fence(client, standby, background=False)
            fence.fence(client, name, background=False)
        naming.drop_alias(name, cid)
        raise
    # Docker's names after the critical path (a thread started earlier would compete for the CPU)
    naming.settle_later(name, _take_name, client, name, standby, cid, killed, done, phases)
    return DockerSandbox.attach(cid, checkpoint.config, name, client)


def promote_docker(client: docker.DockerClient, hook: PhaseHook, checkpoint: Checkpoint, name: str, standby: str,
                   cid: str) -> DockerSandbox:
    """Docker paused the standby (no cgroup of it here): its unpause beside the fence."""
    api = client.api
    # the thaw runs beside the fence: the standby shares nothing with the failed sandbox,
    # and only the rename needs the name the fence frees
    thaw = Background(_unpause, api, cid, f"thaw standby {standby}", name="belayer-standby-thaw")
    try:
        # dead in the kernel's view is enough; Docker's state catches up ~50-150 ms later,
        # and the background removal below waits for it
        fenced = fence.kill(client, name, docker_view=False)
        with translate_errors(f"promote standby {standby}"):
            api.rename(cid, name)
        thaw.result()
        hook(Phase.STANDBY_THAWED)
        promoted = DockerSandbox.attach(cid, checkpoint.config, name, client)
        promoted.check_alive(f"thawed standby of {checkpoint.id}")
    except BaseException:
        thaw.join()
        with contextlib.suppress(Exception):  # under either name: nothing half-promoted runs
            fence.fence(client, standby, background=False)
            fence.fence(client, name, background=False)
        raise
    removal.remove_in_background(client, fenced)
    return promoted


def _take_name(client: docker.DockerClient, name: str, standby: str, cid: str, killed: list[str],
               done: list[str], phases: dict[str, float]) -> None:
    """Docker's half of a promotion, on a thread: the dead containers renamed aside, the
    standby renamed to ``name``, the dead removed. A standby that cannot take the name is
    fenced: a promoted sandbox that a fence of ``name`` would not find never runs on."""
    t0 = time.perf_counter()
    try:
        for dead in killed:
            fence.rename_aside(client, dead, name)
        with translate_errors(f"promote standby {standby}"):
            client.api.rename(cid, name)
    except BaseException:
        with contextlib.suppress(Exception):
            fence.fence(client, standby, background=False)
        raise
    finally:
        naming.drop_alias(name, cid)
        removal.remove_in_background(client, killed + done)
    phases["names_s"] = time.perf_counter() - t0


def _unpause(api: docker.APIClient, container_id: str, what: str) -> None:
    with translate_errors(what):
        api.unpause(container_id)
