"""``cgroup_yard``: dumps walk the host's own cgroup mounts instead of CRIU mounting every
hierarchy inside the freeze; the images are the same, restores land in the new container's
cgroups."""

from __future__ import annotations

import os
from pathlib import Path

import pycriu
import pytest

from belayer_core.procfs import mount_roots
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.criu import cgroup_yard, runtime
from belayer_env.restore.restore import full_restore
from tests.belayer_env.conftest_checkpoint import log_state, start_counter


def test_every_hierarchy_of_this_process_has_a_root_mount_in_the_yard():
    links = dict(cgroup_yard.hierarchies() or ())
    lines = [line.split(":", 2)[1] for line in Path("/proc/self/cgroup").read_text().splitlines()]
    if not links:
        pytest.skip("this host does not mount every cgroup hierarchy at its root: CRIU mounts its own")
    assert set(links) == {"unified" if c == "" else c.removeprefix("name=") for c in lines}
    roots = {m.target: m for m in mount_roots() if m.root == "/"}
    for name, target in links.items():
        assert roots[target].fstype == ("cgroup2" if name == "unified" else "cgroup"), (name, target)


def test_make_links_each_hierarchy_inside_the_private_work_dir(tmp_path):
    if not cgroup_yard.hierarchies():
        pytest.skip("no yard on this host")
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    yard = cgroup_yard.make(work)
    assert yard == work / cgroup_yard.YARD and (yard.stat().st_mode & 0o777) == 0o700
    for name, target in cgroup_yard.hierarchies():
        assert os.readlink(yard / name) == target and (yard / name).is_dir()


def cgroup_image(checkpoint) -> dict:
    """The checkpoint's decoded cgroup image. On cgroup v1 CRIU records ``freezer.state``
    with perms it never initialises (stack bytes that differ from dump to dump; restore
    does not apply them), so those are left out of the comparison."""
    raw = (Path(checkpoint.path) / "runtime" / "cgroup.img").read_bytes()
    image = pycriu.images.loads(raw)
    directories = [d for c in image["entries"][0]["controllers"] for d in c["dirs"]]
    while directories:
        directory = directories.pop()
        directories.extend(directory.get("children", ()))
        for prop in directory.get("properties", ()):
            if prop["name"] == "freezer.state":
                prop.pop("perms", None)
    return image


def test_a_dump_through_the_yard_writes_the_same_cgroup_image_and_restores_into_new_cgroups(
        make_sandbox, ck_store, docker_client, monkeypatch):
    if not cgroup_yard.hierarchies():
        pytest.skip("no yard on this host")
    sb = make_sandbox()
    start_counter(sb)
    images = {}
    checkpoints = {}
    for yard in (False, True):
        monkeypatch.setattr(runtime, "CGROUP_YARD", yard)
        checkpoints[yard] = full_checkpoint(sb, ck_store)
        images[yard] = cgroup_image(checkpoints[yard])
    assert images[True] == images[False]
    restored = full_restore(checkpoints[True], client=docker_client)
    n, ok = log_state(restored)
    assert ok and n > 0
    cid = restored.container_id
    pid = docker_client.api.inspect_container(cid)["State"]["Pid"]
    cgroups = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    assert all(cid in line.split(":", 2)[2] for line in cgroups), cgroups
