"""Incremental capture (only changed layer entries copied while frozen) on real containers
with real CRIU: every checkpoint restores to the frozen instant's tree and memory, alone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.capture.delta import RACY_NS
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox import freezer
from belayer_env.sandbox.treehash import tree_hash
from belayer_env.store.manifest import read_manifest
from tests.belayer_env.conftest_checkpoint import (
    KILL_AT,
    http_get,
    init_pid,
    start_server,
    tracer_of,
)
from tests.conftest import wait_until

EXCLUDE = ("/proc", "/sys", "/dev", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/tmp")
BIG = ("mkdir -p /work/keep && head -c 20000000 /dev/urandom > /work/big.bin && "
       "for i in $(seq 300); do echo $i > /work/keep/k$i; done")  # stays unchanged
SMALL_WRITES = """
set -e
mkdir -p /work/small/{step}
for i in $(seq 150); do echo "{step} $i" > /work/small/{step}/f$i; done
for i in $(seq 20); do echo more >> /work/small/0/f$i 2>/dev/null || true; done
"""


def _meta(ck) -> dict:
    return read_manifest(ck.path)


def test_incremental_restores_like_a_full_one(make_sandbox, ck_store, docker_client):
    """After many small writes next to a big unchanged file, the incremental checkpoint
    copies only the changed entries while frozen and restores to the same tree hash and
    the same process memory as a full (paused) checkpoint of the same boundary."""
    sb = make_sandbox()
    assert sb.execute(BIG)["returncode"] == 0
    assert sb.execute(SMALL_WRITES.format(step=0))["returncode"] == 0
    start_server(sb, 8000)
    first = full_checkpoint(sb, ck_store, 1)
    assert _meta(first)["layer_base"] == "none"  # nothing to compare against: everything copied
    assert sb.execute(SMALL_WRITES.format(step=1))["returncode"] == 0
    hits = http_get(sb, 8000)
    before = tree_hash(sb, exclude=EXCLUDE)

    full = full_checkpoint(sb, ck_store, 2, capture="paused")
    inc = full_checkpoint(sb, ck_store, 3)
    meta = _meta(inc)
    assert meta["capture"] == "incremental" and meta["layer_base"] == "mirror"
    # ~150 new files + 20 appended + their directories, not the 20 MB file nor the image
    assert meta["layer_entries_copied"] < 200 < meta["layer_entries"], meta
    assert inc.size_bytes > 20_000_000  # yet the checkpoint holds the whole layer

    for ck in (full, inc):
        restored = full_restore(ck, client=docker_client)
        assert tree_hash(restored, exclude=EXCLUDE) == before, ck.id
        assert http_get(restored, 8000) == hits + 1, ck.id  # the server's in-memory count


def test_deletions_and_type_changes_between_checkpoints(make_sandbox, ck_store, docker_client):
    """Deleting an image file (a whiteout), an entry added earlier, an opaque directory, a
    file turned into a directory and back, mode/owner-only changes, a new hardlink: all
    captured by the next incremental checkpoint."""
    sb = make_sandbox()
    setup = ("set -e; mkdir -p /work/d/sub /work/x; echo 1 > /work/d/sub/f; echo 2 > /work/gone; "
             "echo 3 > /work/x/keep; echo 4 > /work/becomes-dir; mkdir /work/becomes-file; echo 5 > /work/linked")
    assert sb.execute(setup)["returncode"] == 0
    full_checkpoint(sb, ck_store, 1)
    change = ("set -e; rm /etc/debian_version; rm /work/gone; rm -rf /work/d/sub; "
              "rm -rf /etc/apt && mkdir /etc/apt && echo new > /etc/apt/only-this; "
              "rm /work/becomes-dir && mkdir /work/becomes-dir && echo in > /work/becomes-dir/f; "
              "rmdir /work/becomes-file && echo now-a-file > /work/becomes-file; "
              "chmod 600 /work/x/keep; chown 1234:4321 /work/x; ln /work/linked /work/x/hard")
    assert sb.execute(change)["returncode"] == 0
    before = tree_hash(sb, exclude=EXCLUDE)
    ck = full_checkpoint(sb, ck_store, 2)
    assert _meta(ck)["layer_base"] == "mirror"
    restored = full_restore(ck, client=docker_client)
    assert tree_hash(restored, exclude=EXCLUDE) == before
    r = restored.execute("test ! -e /etc/debian_version && test ! -e /work/gone && test ! -e /work/d/sub "
                         "&& ls /etc/apt && stat -c '%a %u:%g %h' /work/x/keep /work/x /work/x/hard")
    assert r["returncode"] == 0 and r["output"].split() == ["only-this", "600", "0:0", "1", "755", "1234:4321",
                                                            "2", "644", "0:0", "2"], r["output"]


def _restored_long_ago(ck, docker_client):
    """``full_restore``, then the restore's layer stamp moved to now (valid here: no process
    of these sandboxes writes files on its own), once the clock is past the racy margin of
    every entry unpacked: so the next capture skips what came from ``ck``'s layer however
    fast the restore unpacked it (else the entries unpacked within ``RACY_NS`` of the stamp
    are copied again: correct, only not incremental)."""
    restored = full_restore(ck, client=docker_client)
    stamp = restored.layer_installed_ns
    wait_until(lambda: time.time_ns() > stamp + 2 * RACY_NS, 5, "the clock past the racy margin")
    restored.layer_installed_ns = time.time_ns()
    return restored


def test_chain_of_three_incremental_checkpoints_each_restores(make_sandbox, ck_store, docker_client):
    """Three incremental checkpoints in a row (the last one of a restored sandbox): each
    restores to its own boundary's tree and memory, in any order."""
    sb = make_sandbox()
    assert sb.execute(BIG)["returncode"] == 0
    start_server(sb, 8000)
    taken = []
    for step in (1, 2, 3):
        assert sb.execute(SMALL_WRITES.format(step=step) + f"rm -rf /work/small/{step - 1}")["returncode"] == 0
        hits = http_get(sb, 8000)
        taken.append((full_checkpoint(sb, ck_store, step), tree_hash(sb, exclude=EXCLUDE), hits))
        if step == 2:  # go on from a restore of checkpoint 2: checkpoint 3 compares with its layer
            sb = _restored_long_ago(taken[-1][0], docker_client)
            assert http_get(sb, 8000) == hits + 1
    # checkpoint 3: the restored sandbox's entries compared with the mirror checkpoint 2 was tarred from
    assert [_meta(ck)["layer_base"].split(":")[0] for ck, _, _ in taken] == ["none", "mirror", "restored-mirror"]
    assert _meta(taken[2][0])["layer_entries_copied"] < 200 < _meta(taken[2][0])["layer_entries"]
    for ck, tree, hits in reversed(taken):
        restored = full_restore(ck, client=docker_client)
        assert tree_hash(restored, exclude=EXCLUDE) == tree, ck.id
        assert http_get(restored, 8000) == hits + 1, ck.id


def test_checkpoint_needs_no_parent(make_sandbox, ck_store, docker_client):
    """Every checkpoint is self-sufficient: with the previous checkpoint removed from the
    store, the incremental one still restores; and a checkpoint whose restore base (the
    layer.tar of the checkpoint restored, when there is no mirror) is removed while the
    capture is frozen is still complete."""
    sb = make_sandbox()
    assert sb.execute(BIG + " && echo a > /work/a")["returncode"] == 0
    first = full_checkpoint(sb, ck_store, 1)
    assert sb.execute("echo b > /work/b && rm /work/a")["returncode"] == 0
    before = tree_hash(sb, exclude=EXCLUDE)
    second = full_checkpoint(sb, ck_store, 2)
    ck_store.remove(first.id)
    restored = _restored_long_ago(second, docker_client)
    assert tree_hash(restored, exclude=EXCLUDE) == before

    assert restored.execute("echo c > /work/c")["returncode"] == 0
    before = tree_hash(restored, exclude=EXCLUDE)

    def drop_base(phase) -> None:
        if phase == "frozen":
            ck_store.remove(second.id)  # retention takes the restore's base mid-capture

    ck_store.drop_mirror(sb.name)  # no mirror: the base is checkpoint 2's own layer.tar
    third = full_checkpoint(restored, ck_store, 3, phase_hook=drop_base)
    assert _meta(third)["layer_base"] == f"checkpoint:{second.id}"
    assert [c.id for c in ck_store.list(sb.name)] == [third.id]
    again = full_restore(third, client=docker_client)
    assert tree_hash(again, exclude=EXCLUDE) == before


MAPPER = r'''
import mmap, os, time
f = open("/work/m.bin", "r+b")
m = mmap.mmap(f.fileno(), 4096)  # shared, writable: later writes need no page fault
m[0:5] = b"one.."
open("/work/m.ready1", "w").close()
while not os.path.exists("/work/m.go2"):
    time.sleep(0.01)
m[0:5] = b"two.."  # same page, already writable: the file's ctime does not change
open("/work/m.ready2", "w").close()
while True:
    time.sleep(1)
'''


def test_writes_through_a_shared_mapping_are_captured(make_sandbox, ck_store, docker_client):
    """A write through an already-writable shared mapping leaves the file's ctime alone: a
    file mapped shared-writable by a process of the sandbox is copied at every capture
    (and at the one after it is unmapped)."""
    sb = make_sandbox()
    r = sb.execute("mkdir -p /work && head -c 4096 /dev/zero > /work/m.bin && cat > /opt/t/mapper.py <<'EOF'\n"
                   f"{MAPPER}\nEOF\nsetsid python3 /opt/t/mapper.py >/dev/null 2>&1 </dev/null &")
    assert r["returncode"] == 0, r
    wait_until(lambda: sb.execute("test -e /work/m.ready1")["returncode"] == 0, 30, "mapper wrote once")
    full_checkpoint(sb, ck_store, 1)
    sb.execute("touch /work/m.go2")
    wait_until(lambda: sb.execute("test -e /work/m.ready2")["returncode"] == 0, 30, "mapper wrote twice")
    second = full_checkpoint(sb, ck_store, 2)
    assert _meta(second)["layer_base"] == "mirror"
    restored = full_restore(second, client=docker_client)
    assert restored.execute("head -c 5 /work/m.bin")["output"] == "two.."




@pytest.mark.parametrize("phase", ["frozen", "layer_captured"])
def test_checkpointer_killed_while_frozen_leaves_the_sandbox_running(phase, make_sandbox, ck_store):
    """The cgroup is frozen by the checkpointer, not by Docker: when the checkpointer dies
    inside the freeze, the action script fails the dump and, once CRIU is gone, thaws it
    (Docker would not know it is frozen): the sandbox runs on, nothing is published."""
    sb = make_sandbox()
    first = full_checkpoint(sb, ck_store, 1)
    p = subprocess.run([sys.executable, "-c", KILL_AT, sb.container_id, sb.name, str(ck_store.path), phase],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    # CRIU goes on alone: it fails the dump, re-freezes the cgroup it found frozen, detaches
    wait_until(lambda: tracer_of(init_pid(sb)) == 0, 60, "CRIU to let the sandbox's processes go")
    wait_until(lambda: not freezer.is_frozen(sb.container_id), 30, "the orphaned freeze thawed")
    assert sb.execute("echo alive")["output"] == "alive\n"
    assert [c.id for c in ck_store.list()] == [first.id]


def test_mirror_keeps_the_scanned_mtime_of_a_directory_criu_touches(tmp_path, monkeypatch):
    """CRIU makes and removes a temp dir in the container's /tmp while it dumps, after the
    frozen scan may have read /tmp and before tar copies it: the mirror (and so the
    checkpoint's layer) must keep the scanned mtime, the one its index records, or the first
    capture after a restore of that checkpoint finds /tmp "unchanged" yet different (seen
    once at load ~50: "1 entries unchanged since the restore of ... differ ... 'tmp'")."""
    from belayer_env.capture import delta as frozen_delta
    from belayer_env.capture import incremental

    upper, scratch = tmp_path / "upper", tmp_path / "scratch"
    (upper / "tmp").mkdir(parents=True)
    (upper / "work").mkdir()
    (upper / "work" / "a").write_text("a")
    scratch.mkdir()
    real_copy = frozen_delta.copy_entries

    def criu_touches_tmp(up, paths, *args):
        (up / "tmp" / ".criu.mntns.X").mkdir()  # after the scan, before the copy
        (up / "tmp" / ".criu.mntns.X").rmdir()
        real_copy(up, paths, *args)

    monkeypatch.setattr(frozen_delta, "copy_entries", criu_touches_tmp)
    delta = frozen_delta.Delta(upper, scratch, frozen_delta.Base("none"), None)
    delta.start()
    delta.wait()
    assert "tmp" in delta.changed
    mirror = incremental.Mirror(tmp_path / "mirror")
    incremental.update(mirror, upper, delta, "ck1")
    index, now = mirror.read()["entries"], frozen_delta.scan(mirror.tree)
    assert now.keys() == index.keys()
    for path in index:
        assert incremental._same_entry(now[path], index[path]), (path, now[path], index[path])
