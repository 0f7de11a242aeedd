"""``full_restore`` by both image paths, on real containers with real CRIU.

``linked`` (the default: Docker's checkpoint directory holds only symlinks to the verified
images) and ``copied`` (the images themselves, Docker's own way) must give the same
sandbox: same files (tree hash), same memory (a live server's hit counter, an append-only
log with no repeated or missing line), an ordinary Docker container (``docker ps``,
labels, ``belayer gc``, exec, stop, rm), a later checkpoint of it, and a fenced old owner.
A restore that fails in CRIU, or whose process is SIGKILLed, leaves nothing running and
nothing on disk that the next restore or ``belayer gc`` does not remove.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_core.errors import InfraError, RestoreFailed, UsageError
from belayer_core.procfs import mount_of
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.ops.gc import list_managed, reap
from belayer_env.restore import ctrd_copies
from belayer_env.restore.cleanup import wait_cleaned
from belayer_env.restore.prestaging import LAYER_IMAGE, PREFIX, docker_root, docker_tmp, prestage
from belayer_env.restore.restore import full_restore
from belayer_env.restore.staged import RESTORE_NAME, same_mount
from belayer_env.sandbox.disk import layer_dir
from belayer_env.sandbox.ownership import SANDBOX_NAME
from belayer_env.sandbox.treehash import tree_hash
from belayer_env.store import in_memory
from belayer_env.store.store import owner_tag
from tests.belayer_env.capture.test_checkpoint import EXCLUDE
from tests.belayer_env.conftest_checkpoint import http_get, log_state, start_counter, start_server
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[3]
FILES = "mkdir -p /work && echo one > /work/a && rm -f /etc/debian_version && head -c 100000 /dev/urandom > /work/b"

KILL_AT = """
import os, signal, sys
from belayer_env.store.store import CheckpointStore
from belayer_env.restore.restore import full_restore
store, ck_id, phase = sys.argv[1:4]
def hook(p):
    if p == phase:
        os.kill(os.getpid(), signal.SIGKILL)
full_restore(CheckpointStore(store).get(ck_id), phase_hook=hook)
"""


def containers_of(client, name: str, **filters) -> list[dict]:
    """Docker's list entries of every container labelled as, or named, sandbox ``name``."""
    found = {c["Id"]: c for c in client.api.containers(all=True, filters={"label": f"{SANDBOX_NAME}={name}", **filters})}
    found.update({c["Id"]: c for c in client.api.containers(all=True, filters={"name": f"^/{name}", **filters})})
    return list(found.values())


def leftovers_in_tmp(client) -> list[Path]:
    """This process's restores' spent copies: in Docker's tmp dir, and containerd's unpacked
    copies of the checkpoint directory (containerd never removes those)."""
    assert wait_cleaned(), "a restore's clean-up thread did not finish"  # spent copies go on a thread
    assert ctrd_copies.temp_dirs(), "containerd's temp dir not found: its copies would go unchecked"
    return ([d for d in docker_tmp(client).glob(f"{PREFIX}*~{owner_tag()}") if "-staged-" not in d.name]
            + [d for d, nonce in ctrd_copies.copies() if nonce.endswith(f"~{owner_tag()}")])


def pages_to_restore(client, name: str) -> list[Path]:
    """The pages images in the checkpoint directory of the container a restore of sandbox
    ``name`` has created and not started yet (a phase hook's view)."""
    [new] = client.api.containers(all=True, filters={"label": f"{SANDBOX_NAME}={name}", "status": "created"})
    ckdir = Path(docker_root(client)) / "containers" / new["Id"] / "checkpoints" / RESTORE_NAME
    pages = sorted(ckdir.glob("pages-*.img"))
    assert pages, list(ckdir.iterdir())
    return pages


def assert_ordinary_docker_container(client, sb) -> None:
    """What ``docker ps``/``inspect``/``top`` and ``belayer gc`` see of a restored sandbox."""
    [entry] = client.api.containers(filters={"name": f"^/{sb.name}$"})  # running ones only
    assert entry["Id"] == sb.container_id and entry["State"] == "running"
    assert entry["Labels"][SANDBOX_NAME] == sb.name, entry["Labels"]
    [managed] = [m for m in list_managed(client) if m.id == sb.container_id]
    assert managed.sandbox == sb.name and not managed.orphaned
    state = client.api.inspect_container(sb.container_id)["State"]
    assert state["Running"] and state["Pid"] > 0
    procs = [p[-1] for p in client.api.top(sb.container_id)["Processes"]]
    assert any("counter.py" in p for p in procs), procs  # Docker's container holds the restored tree
    assert not (Path(docker_root(client)) / "containers" / sb.container_id / "checkpoints" / RESTORE_NAME).exists()


@pytest.mark.parametrize("images", ["linked", "copied"])
def test_restore_chain_keeps_state_and_gives_an_ordinary_container(images, make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    assert sb.execute(FILES)["returncode"] == 0
    start_counter(sb, heap_mib=20)
    start_server(sb, 8000)
    hits = http_get(sb, 8000)
    for step in (1, 2):
        before = tree_hash(sb, exclude=EXCLUDE)
        ck = full_checkpoint(sb, ck_store, step)
        logged = log_state(sb)[0]
        if step == 2:
            assert prestage(ck, docker_client) is not None  # the pre-staged path too
        old = sb
        sb = full_restore(ck, client=docker_client, images=images)
        assert sb.restored_from == ck.id and not sb.degraded and sb.container_id != old.container_id
        assert tree_hash(sb, exclude=EXCLUDE) == before
        wait_until(lambda s=sb, n=logged: log_state(s)[0] > n + 5, 30, "restored counter to keep logging")
        assert log_state(sb)[1], "append-mode log has a duplicated or missing line after restore"
        hits += 1
        assert http_get(sb, 8000) == hits  # the server's in-memory counter went on
        assert_ordinary_docker_container(docker_client, sb)
        assert sb.execute(f"echo {step} >> /work/steps")["returncode"] == 0  # exec into it
        assert leftovers_in_tmp(docker_client) == []
    assert sb.execute("cat /work/steps")["output"].split() == ["1", "2"]
    api = docker_client.api
    api.stop(sb.container_id, timeout=1)
    assert not api.inspect_container(sb.container_id)["State"]["Running"]
    api.remove_container(sb.container_id)
    assert not api.containers(all=True, filters={"id": sb.container_id})


def test_old_owner_is_fenced_by_a_newer_restore(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    sb.execute("echo before > /root/state")
    ck = full_checkpoint(sb, ck_store, 1)
    restored = full_restore(ck, client=docker_client)
    with pytest.raises(InfraError):  # the old handle's container is dead: its write cannot land
        sb.execute("echo late > /root/late")
    assert not docker_client.api.containers(filters={"id": sb.container_id})
    assert restored.execute("cat /root/state")["output"] == "before\n"
    assert "No such file" in restored.execute("cat /root/late")["output"]


def test_unknown_images_path_is_a_usage_error(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    ck = full_checkpoint(sb, ck_store, 1)
    with pytest.raises(UsageError, match="images"):
        full_restore(ck, client=docker_client, images="rsync")
    assert sb.is_alive(), "a refused restore fenced the sandbox"


@pytest.mark.parametrize("images", ["linked", "copied"])
def test_failed_criu_restore_leaves_nothing_and_a_retry_restores(images, make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    start_counter(sb)
    sb.execute("echo kept > /root/state")
    ck = full_checkpoint(sb, ck_store, 1)

    def lose_pages(phase: str) -> None:
        """After verification, right before the start: a pages image vanishes (CRIU must fail)."""
        if phase != "runtime_verified":
            return
        for p in pages_to_restore(docker_client, sb.name):
            p.resolve().unlink()  # the verified file itself (a link in "linked" mode)

    with pytest.raises(RestoreFailed, match="CRIU restore failed") as e:
        full_restore(ck, client=docker_client, images=images, phase_hook=lose_pages)
    assert e.value.checkpoint == ck.id
    wait_until(lambda: containers_of(docker_client, sb.name) == [], 60,
               "every container of the sandbox (the fenced old one, the failed new one) to be removed")
    assert leftovers_in_tmp(docker_client) == []
    restored = full_restore(ck, client=docker_client, images=images)  # a retry works
    assert restored.execute("cat /root/state")["output"] == "kept\n"
    wait_until(lambda: log_state(restored)[1] and log_state(restored)[0] > 0, 30, "restored counter consistent")


@pytest.mark.parametrize("phase", ["created", "runtime_verified", "started"])
def test_sigkilled_restore_leaves_nothing_running_that_gc_and_a_retry_do_not_remove(
        phase, make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    start_counter(sb)
    sb.execute("echo kept > /root/state")
    ck = full_checkpoint(sb, ck_store, 1)
    p = subprocess.Popen([sys.executable, "-c", KILL_AT, str(ck_store.path), ck.id, phase],
                         stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    _, err = p.communicate(timeout=180)
    assert p.returncode == -signal.SIGKILL, err[-2000:]
    left = [d for d, nonce in ctrd_copies.copies() if f"~{p.pid}-" in nonce]
    assert len(left) == (1 if phase == "started" else 0), left  # containerd unpacked the images to start it
    assert set(left) <= set(ctrd_copies.sweep()) and not [d for d in left if d.exists()]  # `belayer gc`
    orphans = [m for m in list_managed(docker_client) if m.orphaned and m.owner.endswith(f":{p.pid}")]
    assert [m.sandbox for m in orphans] == [sb.name], orphans  # the new container, owned by the dead process
    running = [c for c in containers_of(docker_client, sb.name) if c["State"] == "running"]
    if phase == "started":  # Docker started it: a whole restore, but its owner is gone
        assert [c["Id"] for c in running] == [orphans[0].id]
    else:  # the old sandbox may live on (its fence may not have finished); the new one never ran
        assert orphans[0].id not in [c["Id"] for c in running]
    assert reap(docker_client, orphans) == [orphans[0].id]  # what `belayer gc` does
    restored = full_restore(ck, client=docker_client)  # the retry fences whatever is left of the name
    assert [c["Id"] for c in containers_of(docker_client, sb.name, status="running")] == [restored.container_id]
    assert restored.execute("cat /root/state")["output"] == "kept\n"
    wait_until(lambda: log_state(restored)[1] and log_state(restored)[0] > 0, 30, "restored counter consistent")
    assert not list(docker_tmp(docker_client).glob(f"{PREFIX}*~{p.pid}-*")), "the dead restore's files stayed"


def test_prestaged_capped_layer_is_mounted_whole_and_the_cap_holds(make_sandbox, ck_store, docker_client):
    sb = make_sandbox(disk="64m")
    assert sb.execute(FILES)["returncode"] == 0
    start_counter(sb)
    before = tree_hash(sb, exclude=EXCLUDE)
    ck = full_checkpoint(sb, ck_store, 1)
    staged = prestage(ck, docker_client)
    assert staged is not None and (staged / LAYER_IMAGE).is_file() and not (staged / "layer").exists()
    phases: list[str] = []
    restored = full_restore(ck, client=docker_client, phase_hook=phases.append)
    assert "staged" in phases, phases
    assert tree_hash(restored, exclude=EXCLUDE) == before
    wait_until(lambda: log_state(restored)[1] and log_state(restored)[0] > 0, 30, "restored counter consistent")
    assert os.path.ismount(layer_dir(docker_client.api.inspect_container(restored.container_id)))
    r = restored.execute("head -c 100M /dev/zero > /work/big; echo rc=$?")
    assert "No space left" in r["output"] and "rc=1" in r["output"], r  # the 64m cap holds
    assert restored.execute("rm /work/big && echo again >> /work/a && cat /work/a")["output"] == "one\nagain\n"


def test_restore_of_a_sandbox_whose_cwd_is_not_in_the_image(make_sandbox, ck_store, docker_client):
    # Docker creates a working dir missing from the image in a new container's upperdir;
    # the unpacked layer replaces it (it once failed every restore that was not pre-staged)
    sb = make_sandbox(cwd="/srv/task")
    assert sb.execute("mkdir -p /srv/task && echo state > /srv/task/f", cwd="/")["returncode"] == 0
    before = tree_hash(sb, exclude=EXCLUDE)
    ck = full_checkpoint(sb, ck_store, 1)
    for _ in range(2):  # the same checkpoint again, as after a second fault
        sb = full_restore(ck, client=docker_client)
        assert tree_hash(sb, exclude=EXCLUDE) == before
        assert sb.execute("cat f")["output"] == "state\n"
        assert leftovers_in_tmp(docker_client) == []


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, fstype, source) of the mount holding ``path``."""
    m = mount_of(str(path))
    return (m.target, m.fstype, m.source) if m is not None else ("", "", "")


def test_not_prestaged_images_are_verified_into_memory_and_unmounted_after(make_sandbox, ck_store, docker_client):
    """Images that cannot be hardlinked into Docker's tmp dir (another mount) are copied +
    verified into a tmpfs of the restore's own, which goes once the restore is done."""
    sb = make_sandbox()
    start_counter(sb, heap_mib=20)
    ck = full_checkpoint(sb, ck_store, 1)
    cross_mount = not same_mount(Path(ck.path) / "manifest.json", docker_tmp(docker_client))
    held: list[tuple[str, str, str]] = []

    links: list[tuple[str, str, str] | None] = []

    def where_images_are(phase: str) -> None:
        if phase == "runtime_verified":
            pages = pages_to_restore(docker_client, sb.name)
            held.append(_mount_of(pages[0].resolve()))
            own = pages[0].parent.parent  # the container's checkpoints directory
            links.append(_mount_of(own.resolve()) if own.is_symlink() else None)

    restored = full_restore(ck, client=docker_client, use_staged=False, phase_hook=where_images_are)
    wait_until(lambda: log_state(restored)[1] and log_state(restored)[0] > 0, 30, "restored counter consistent")
    [(point, fstype, source)] = held
    if cross_mount:  # the store is on another mount (here: /tmp vs Docker's bind-mounted root)
        assert (fstype, source) == ("tmpfs", in_memory.RESTORE), held
        # the links Docker gets were made beside the images, in memory, not on Docker's disk
        assert links == [(point, "tmpfs", in_memory.RESTORE)], links
        assert leftovers_in_tmp(docker_client) == []
        assert not os.path.ismount(point), f"the restore's tmpfs {point} is still mounted"
    else:  # hardlinks into Docker's tmp dir: nothing copied at all
        assert fstype != "tmpfs", held
