"""The injected faults themselves: real, and nothing of the injector left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_core.errors import CheckpointFailed
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.faults import inject as faults
from belayer_env.faults.inject import _oom_from_host, _sandbox_cgroups, oom_container
from belayer_env.sandbox import freezer
from tests.conftest import wait_until


def _hogs() -> list[int]:
    """Host processes running ``oom_hog.py``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"oom_hog.py" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _hog_from_host(docker_client, sb) -> bool:
    """Whether the OOM fault's hog runs from the host here (else by docker exec)."""
    init = docker_client.api.inspect_container(sb.container_id)["State"]["Pid"]
    return _sandbox_cgroups(init, sb.container_id) is not None


def _oom_killed(docker_client, sb) -> bool:
    state = docker_client.api.inspect_container(sb.container_id)["State"]
    return not state["Running"] and state["OOMKilled"]


def test_oom_fault_is_the_kernel_killing_init_and_leaves_nothing_behind(make_sandbox, docker_client):
    sb = make_sandbox(memory="256m")
    host_side = _hog_from_host(docker_client, sb)
    oom_container(docker_client, sb.container_id)
    wait_until(lambda: not sb.is_alive(), 20, "the OOM fault to take the container down")
    # dead in the kernel's view comes first; Docker records the exit and the OOM a moment later
    wait_until(lambda: _oom_killed(docker_client, sb), 20, "Docker to report the container OOM-killed")
    if host_side:  # a local daemon: the hog ran on the host
        wait_until(lambda: not _hogs(), 20, "the OOM hog to exit once the container's init died")


def test_a_capture_racing_the_oom_fault_is_never_refused_as_a_running_command(make_sandbox, docker_client, ck_store):
    sb = make_sandbox(memory="256m")
    if not _hog_from_host(docker_client, sb):
        pytest.skip("the OOM fault runs as an exec here (the sandbox's cgroups are not local)")
    oom_container(docker_client, sb.container_id)
    try:
        full_checkpoint(sb, ck_store, 1)  # the dump may win the race or lose it: both are real
    except CheckpointFailed as e:
        assert "running a command" not in str(e), e
    wait_until(lambda: not sb.is_alive(), 20, "the OOM fault to take the container down")
    wait_until(lambda: not _hogs(), 20, "the OOM hog to exit once the container's init died")


def test_the_oom_hog_is_frozen_with_the_sandbox(make_sandbox, docker_client):
    """A capture freezes the sandbox: memory grown by its processes stops growing, so the
    hog must stop too (else it OOM-kills a frozen sandbox under CRIU's dump)."""
    sb = make_sandbox(memory="256m")
    if not _hog_from_host(docker_client, sb):
        pytest.skip("the OOM fault runs as an exec here (the sandbox's cgroups are not local)")
    control = freezer.control_file(sb.container_id)
    procs = control.parent / "cgroup.procs"
    docker_client.api.pause(sb.container_id)
    oom_container(docker_client, sb.container_id)
    wait_until(lambda: set(_hogs()) & {int(p) for p in procs.read_text().split()}, 20,
               "a hog child to join the paused sandbox's freezer cgroup")
    wait_until(lambda: control.read_text().strip() == "FROZEN", 20, "the hog child to be frozen with the sandbox")
    assert sb.is_alive()
    docker_client.api.unpause(sb.container_id)
    wait_until(lambda: not sb.is_alive(), 20, "the OOM fault to take the container down once thawed")
    wait_until(lambda: _oom_killed(docker_client, sb), 20, "Docker to report the container OOM-killed")
    wait_until(lambda: not _hogs(), 20, "the OOM hog to exit once the container's init died")


def test_oom_from_host_never_touches_a_process_outside_the_container(make_sandbox, docker_client):
    sb = make_sandbox()
    before = Path("/proc/self/oom_score_adj").read_text()
    assert _oom_from_host(os.getpid(), sb.container_id) is False  # e.g. a pid a remote daemon reported
    assert Path("/proc/self/oom_score_adj").read_text() == before
    assert not _hogs()


def test_the_oom_hog_stops_when_it_cannot_join_the_sandbox(make_sandbox, docker_client, tmp_path):
    """A child that cannot join the sandbox's cgroups would take the host's memory: the hog
    says so and exits (``oom_container`` then falls back to docker exec)."""
    sb = make_sandbox()
    init = docker_client.api.inspect_container(sb.container_id)["State"]["Pid"]
    proc = subprocess.run([sys.executable, "-I", "-S", str(faults._OOM_HOG), str(init), str(tmp_path / "no" / "cgroup.procs")],
                          capture_output=True, timeout=60)
    assert proc.stdout.startswith(b"failed: a child could not join"), proc
    assert sb.is_alive()
