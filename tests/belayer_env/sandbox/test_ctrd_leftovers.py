"""What containerd keeps of sandbox containers Docker has forgotten: ``belayer gc`` removes it,
and so does the removal of a restored container Docker lost (``removal.remove``).

The leftovers are made the way the incident made them, on the real Docker, containerd and
shim: containerd is told (``containerd publish``, the way a shim reports an exit) that a
running container's init exited. Docker marks the container exited and its clean-up fails
("cannot delete running task ...: failed precondition" in dockerd's log); Docker's removal
then forgets it while containerd keeps the container, its running task and the task's
``containerd-shim-runc-v2``. A container that is not a Belayer sandbox, made the same way,
is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from belayer.cli import main as cli_main
from belayer_core.errors import SandboxLost
from belayer_core.procfs import processes
from belayer_env import DockerSandbox
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.ops.gc import containerd_leftovers
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox import containerd, ctrd_leftovers
from belayer_env.sandbox.containerd import Daemon, locate
from belayer_env.sandbox.ctrd_leftovers import Leftover
from belayer_env.sandbox.removal import wait_removed
from tests.conftest import wait_until

FOREIGN_LABEL = "belayer-test.ctrd-foreign"


@pytest.fixture
def ctrd(docker_client) -> Daemon:
    for tool in (containerd.CTR, "containerd"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: Debian's containerd package (a dependency of docker.io, "
                        "`bash scripts/setup.sh`) ships it")
    return locate(docker_client)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value: bytes | int) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _task_exit(container_id: str, pid: int) -> bytes:
    """A ``types.Any`` holding containerd's ``events.TaskExit`` of the init ``pid`` (exit 137)."""
    now = time.time_ns()
    exited_at = _field(1, now // 10**9) + _field(2, now % 10**9)
    event = (_field(1, container_id.encode()) + _field(2, container_id.encode()) + _field(3, pid)
             + _field(4, 137) + _field(5, exited_at))
    return _field(1, b"containerd.events.TaskExit") + _field(2, event)


def docker_loses(client: docker.DockerClient, daemon: Daemon, container_id: str) -> None:
    """Make Docker take the running container ``container_id`` for exited while its task runs on."""
    pid = client.api.inspect_container(container_id)["State"]["Pid"]
    subprocess.run(["containerd", "--address", daemon.address, "publish", "--namespace", daemon.namespace,
                    "--topic", "/tasks/exit"], input=_task_exit(container_id, pid), check=True, timeout=30)
    assert client.api.wait(container_id, condition="not-running", timeout=60)["StatusCode"] == 137
    assert tasks(daemon)[container_id] == "RUNNING"  # what the incident left: containerd's task runs on


def make_leftover(client: docker.DockerClient, daemon: Daemon, container_id: str) -> None:
    """Docker loses the container, then removes it: only containerd still has it."""
    docker_loses(client, daemon, container_id)
    client.api.remove_container(container_id, force=True, v=True)
    with pytest.raises(docker.errors.NotFound):
        client.api.inspect_container(container_id)


def tasks(daemon: Daemon) -> dict[str, str]:
    return {cid: status for cid, (status, _) in containerd.tasks(daemon).items()}


def containers(daemon: Daemon) -> set[str]:
    return set(containerd.ctr(daemon, "containers", "ls", "-q").split())


def shim_of(container_id: str) -> int:
    """The pid of the ``containerd-shim-runc-v2`` serving ``container_id``."""
    for proc in processes():
        if proc.comm.startswith("containerd-shim"):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
                if container_id.encode() in argv:
                    return proc.pid
    raise AssertionError(f"no shim serves {container_id[:12]}")


@contextlib.contextmanager
def watching(pids: list[int]) -> Iterator[dict[int, int]]:
    """pidfds of ``pids``, taken while they run (a pid reused later is never mistaken for them)."""
    fds = {pid: os.pidfd_open(pid) for pid in pids}
    try:
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def exited(pidfd: int, timeout_s: float = 30.0) -> bool:
    """Wait for the process of ``pidfd`` to exit (the pidfd turns readable); no polling."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def cleanup(client: docker.DockerClient, daemon: Daemon, ids: list[str]) -> None:
    for cid in ids:
        with contextlib.suppress(docker.errors.NotFound):
            client.api.remove_container(cid, force=True, v=True)
        if cid in containers(daemon):
            ctrd_leftovers.remove(daemon, Leftover(cid, None, None, f"{daemon.exec_root}/containerd/{cid}"))


def test_gc_removes_sandboxes_containerd_kept_and_leaves_another_container(docker_client, ctrd, capsys):
    running = DockerSandbox(client=docker_client, name_prefix="belayer-ctrdtest")
    stopped = DockerSandbox(client=docker_client, name_prefix="belayer-ctrdtest")
    foreign = docker_client.containers.run(running.config.image, ["sleep", "infinity"], detach=True,
                                           labels={FOREIGN_LABEL: "1"}, network_mode="none").id
    ours = [running.container_id, stopped.container_id]
    try:
        for cid in [*ours, foreign]:
            make_leftover(docker_client, ctrd, cid)
        # one killed after Docker forgot it (exit 137): its task STOPPED, its shim alive
        init = containerd.tasks(ctrd)[stopped.container_id][1]
        assert init is not None
        with watching([init]) as fds:
            os.kill(init, signal.SIGKILL)
            assert exited(fds[init])
        wait_until(lambda: tasks(ctrd).get(stopped.container_id) == "STOPPED", 30, "the killed task STOPPED")
        shims = {cid: shim_of(cid) for cid in [*ours, foreign]}
        inits = {cid: containerd.tasks(ctrd)[cid][1] for cid in (running.container_id, foreign)}

        dry = containerd_leftovers(docker_client, dry_run=True)
        assert dry.unavailable is None
        found = {lo.id: lo.task for lo in dry.found}
        assert found[running.container_id] == "RUNNING" and found[stopped.container_id] == "STOPPED"
        assert foreign not in found and dry.removed == []
        assert set(ours) <= containers(ctrd)  # a dry run removes nothing

        assert cli_main(["gc", "--dry-run", "--json"]) == 0
        listed = {lo["id"]: lo for lo in json.loads(capsys.readouterr().out)["containerd_leftovers"]}
        assert not listed[running.container_id]["removed"] and foreign not in listed

        with watching([*shims.values(), inits[running.container_id]]) as fds:
            done = containerd_leftovers(docker_client)
            assert set(ours) <= set(done.removed) and not done.failed
            left_tasks, left = tasks(ctrd), containers(ctrd)
            for cid in ours:
                assert cid not in left_tasks and cid not in left
                assert not os.path.exists(f"{ctrd.exec_root}/containerd/{cid}")  # Docker's bundle dir
                assert exited(fds[shims[cid]]), f"the shim of {cid[:12]} still runs"
            assert exited(fds[inits[running.container_id]])  # the sandbox's processes are gone
        # the other container, made the same way, is untouched: still there and running
        assert foreign in containers(ctrd) and tasks(ctrd)[foreign] == "RUNNING"
        assert os.path.exists(f"/proc/{shims[foreign]}") and os.path.exists(f"/proc/{inits[foreign]}")
    finally:
        cleanup(docker_client, ctrd, [*ours, foreign])


def test_the_fence_of_a_restored_container_docker_lost_removes_it_from_containerd(make_sandbox, ck_store,
                                                                                   docker_client, ctrd):
    """The incident's shape: a sandbox restored from a CRIU checkpoint, which Docker then takes
    for exited while its task runs on (an exec fails: "is not running"). The next restore
    fences it; that removal leaves nothing in containerd and ends its shim."""
    sb = make_sandbox()
    ck = full_checkpoint(sb, ck_store, 1)
    restored = full_restore(ck, client=docker_client)
    lost = restored.container_id
    try:
        docker_loses(docker_client, ctrd, lost)
        with pytest.raises(SandboxLost):
            restored.execute("true")
        shim, init = shim_of(lost), containerd.tasks(ctrd)[lost][1]
        assert init is not None
        with watching([shim, init]) as fds:
            again = full_restore(ck, client=docker_client)  # the recovery: fences ``lost``, removes it
            assert wait_removed(60)
            assert exited(fds[init]) and exited(fds[shim])
        assert lost not in tasks(ctrd) and lost not in containers(ctrd)
        assert not os.path.exists(f"{ctrd.exec_root}/containerd/{lost}")
        assert again.execute("echo ok")["output"] == "ok\n"
    finally:
        cleanup(docker_client, ctrd, [lost])  # make_sandbox fences the sandbox's name


def test_closing_a_sandbox_docker_lost_leaves_nothing_in_containerd(docker_client, ctrd):
    """An episode's end (``DockerSandbox.close``) on a sandbox Docker took for exited while its
    task ran on: the close removes the task, its shim and the container from containerd too."""
    sb = DockerSandbox(client=docker_client, name_prefix="belayer-ctrdtest")
    lost = sb.container_id
    try:
        docker_loses(docker_client, ctrd, lost)
        shim, init = shim_of(lost), containerd.tasks(ctrd)[lost][1]
        assert init is not None
        with watching([shim, init]) as fds:
            sb.close()
            assert exited(fds[init]) and exited(fds[shim])
        assert lost not in tasks(ctrd) and lost not in containers(ctrd)
        assert not os.path.exists(f"{ctrd.exec_root}/containerd/{lost}")
    finally:
        cleanup(docker_client, ctrd, [lost])


def test_gc_says_it_cannot_look_without_ctr(docker_client, monkeypatch):
    monkeypatch.setattr(containerd, "CTR", f"no-such-ctr-{uuid.uuid4().hex[:8]}")
    result = containerd_leftovers(docker_client, dry_run=True)
    assert result.found == [] and "not found" in (result.unavailable or "")
    assert ctrd_leftovers.after_removal(docker_client, uuid.uuid4().hex * 2) == []
