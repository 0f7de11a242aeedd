"""full_checkpoint / full_restore on real containers with real CRIU: the properties."""

from __future__ import annotations

import threading

import pytest

from belayer_core.errors import CheckpointFailed, RestoreFailed
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.capture.pending import start_checkpoint
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox.treehash import tree_hash
from tests.belayer_env.conftest_checkpoint import (
    TRY_LOCK,
    http_get,
    log_state,
    start_counter,
    start_server,
)
from tests.conftest import wait_until

# every kind of change overlay has to carry: deletions (whiteouts), an opaque directory,
# modes, owners, symlinks, hardlinks, a sparse file, a large file, special names
FS_CHANGES = """
set -e
mkdir -p /work/repo/sub && cd /work/repo
echo hello > a.txt && chmod 640 a.txt && chown 1234:4321 a.txt
ln -s a.txt link && ln a.txt hard
head -c 3000000 /dev/urandom > big.bin
truncate -s 200M sparse.img && echo tail >> sparse.img
printf 'x' > 'name with spaces' && chmod 4755 'name with spaces'
rm -f /etc/debian_version /usr/bin/yes
rm -rf /etc/apt && mkdir /etc/apt && echo new > /etc/apt/only-this
mkfifo /work/repo/fifo
"""
EXCLUDE = ("/proc", "/sys", "/dev", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/tmp")


def test_roundtrip_keeps_files_processes_sockets_and_locks(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    assert sb.execute(FS_CHANGES)["returncode"] == 0
    start_counter(sb, heap_mib=20)
    start_server(sb, 8000)
    start_server(sb, 8001, redirect=False)  # logs to its command's output file (see docs/capture.md)
    sb.execute("setsid python3 /opt/t/locker.py /tmp/lk >/dev/null 2>&1 </dev/null &")
    wait_until(lambda: sb.execute("test -e /tmp/lk.held")["returncode"] == 0, 30, "locker holding /tmp/lk")
    sb.execute("setsid python3 /opt/t/tcp_pair.py /tmp/tcp >/dev/null 2>&1 </dev/null &")
    wait_until(lambda: sb.execute("cat /tmp/tcp")["returncode"] == 0, 30, "tcp pair exchanging")
    before = tree_hash(sb, exclude=EXCLUDE)
    hits_before = http_get(sb, 8000)

    ck = full_checkpoint(sb, ck_store, 3)
    assert ck.has_runtime and ck.step == 3 and ck.sandbox == sb.name
    assert 0 < ck.frozen_s < ck.total_s and ck.size_bytes > 20 << 20
    assert [c.id for c in ck_store.list(sb.name)] == [ck.id]
    logged_at_ck = log_state(sb)[0]
    assert sb.execute("echo after-checkpoint > /work/repo/later.txt")["returncode"] == 0  # not in ck

    restored = full_restore(ck, client=docker_client)
    assert restored.restored_from == ck.id and restored.degraded is False
    assert restored.container_id != sb.container_id
    assert not docker_client.api.containers(filters={"id": sb.container_id}), "old container still running"
    wait_until(lambda: not docker_client.api.containers(all=True, filters={"id": sb.container_id}), 60,
               "the fenced container to be removed in the background")

    assert tree_hash(restored, exclude=EXCLUDE) == before
    assert restored.execute("du -k /work/repo/sparse.img | cut -f1")["output"].strip() in {"4", "8", "12"}
    # the counter continues from its in-memory state: the log grows with no gap and no repeat
    wait_until(lambda: log_state(restored)[0] > logged_at_ck + 5, 30, "restored counter to keep logging")
    n, consecutive = log_state(restored)
    assert consecutive, "append-mode log has a duplicated or missing line after restore"
    assert http_get(restored, 8000) == hits_before + 1  # same listening socket, same memory
    assert http_get(restored, 8001) >= 1
    assert restored.execute(TRY_LOCK.format(path="/tmp/lk"))["output"].strip() == "held"
    assert restored.execute("ps -eo args | grep -c '[c]ounter.py'")["output"].strip() == "1"
    # an established loopback TCP connection keeps exchanging (its process asserts order)
    seen = int(restored.execute("cat /tmp/tcp")["output"])
    wait_until(lambda: int(restored.execute("cat /tmp/tcp")["output"] or 0) > seen + 3, 30,
               "established TCP connection to carry on after restore")
    assert restored.execute("ps -eo args | grep -c '[t]cp_pair.py'")["output"].strip() == "1"


def test_restored_sandbox_checkpoints_and_restores_again(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    start_counter(sb)
    for step in (1, 2, 3):
        sb.execute(f"echo {step} >> /root/steps")
        ck = full_checkpoint(sb, ck_store)  # no step: the store numbers it, one past the newest
        assert ck.step == step
        sb = full_restore(ck, client=docker_client)
        assert sb.execute("cat /root/steps")["output"].split() == [str(s) for s in range(1, step + 1)]
        wait_until(lambda s=sb: log_state(s)[1] and log_state(s)[0] > 0, 30, "counter consistent")
    assert len(ck_store.list(sb.name)) == 3


def test_corrupt_checkpoint_raises_restore_failed_and_older_one_restores(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    sb.execute("echo one > /root/state")
    good = full_checkpoint(sb, ck_store, 1)
    sb.execute("echo two > /root/state")
    bad = full_checkpoint(sb, ck_store, 2)
    pages = max((bad.path / "runtime").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    with open(pages, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(RestoreFailed) as e:
        full_restore(bad, client=docker_client)
    assert e.value.checkpoint == bad.id and bad.id in str(e.value)

    (good.path / "layer.tar").open("r+b").truncate(10)
    with pytest.raises(RestoreFailed) as e:
        full_restore(good, client=docker_client)
    assert e.value.checkpoint == good.id

    (bad.path / "manifest.json").unlink()
    with pytest.raises(RestoreFailed, match="incomplete"):
        full_restore(bad, client=docker_client)


def test_fs_only_checkpoint_needs_allow_degraded(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    start_counter(sb)
    sb.execute("echo kept > /root/file")
    ck = full_checkpoint(sb, ck_store, 1, runtime=False)
    assert not ck.has_runtime
    with pytest.raises(RestoreFailed, match="allow_degraded"):
        full_restore(ck, client=docker_client)
    restored = full_restore(ck, allow_degraded=True, client=docker_client)
    assert restored.degraded is True
    assert restored.execute("cat /root/file")["output"] == "kept\n"
    assert restored.execute("ps -eo args | grep -c '[c]ounter.py'")["output"].strip() == "0"


def test_two_sandboxes_checkpoint_concurrently(make_sandbox, ck_store, docker_client):
    a, b = make_sandbox(), make_sandbox()
    for sb in (a, b):
        sb.execute(f"echo {sb.name} > /root/me")
        start_counter(sb, heap_mib=10)
    pa, pb = start_checkpoint(a, ck_store, 1), start_checkpoint(b, ck_store, 1)
    cka, ckb = pa.wait(60), pb.wait(60)
    assert cka and ckb and cka.sandbox == a.name and ckb.sandbox == b.name
    for ck in (cka, ckb):
        restored = full_restore(ck, client=docker_client)
        assert restored.execute("cat /root/me")["output"].strip() == ck.sandbox
        wait_until(lambda r=restored: log_state(r)[0] > 0 and log_state(r)[1], 30, "counter consistent")


def test_start_checkpoint_thaws_and_cancel_publishes_nothing(make_sandbox, ck_store):
    sb = make_sandbox()
    pending = start_checkpoint(sb, ck_store, 1)
    assert pending.thawed.wait(30), "sandbox not thawed"
    assert sb.execute("echo ok")["output"] == "ok\n"
    assert pending.wait(60) is not None and pending.done()

    frozen_seen = []
    pending = start_checkpoint(sb, ck_store, 2, phase_hook=frozen_seen.append)
    pending.cancel()
    assert pending.wait(60) is None
    assert [c.step for c in ck_store.list(sb.name)] == [1]
    assert sb.execute("echo running")["output"] == "running\n"
    assert not docker_client_paused(sb)


def docker_client_paused(sb) -> bool:
    return sb.client.api.inspect_container(sb.container_id)["State"]["Paused"]


def test_refuses_while_a_command_runs(make_sandbox, ck_store):
    sb = make_sandbox()
    done = threading.Event()
    # the command runs until the test lets it go (not for a fixed time a loaded machine can miss)
    worker = threading.Thread(target=lambda: (sb.execute(
        "touch /tmp/started; while [ ! -e /tmp/go ]; do sleep 0.05; done", timeout=120), done.set()))
    worker.start()
    wait_until(lambda: sb.execute("test -e /tmp/started")["returncode"] == 0, 30, "command started")
    with pytest.raises(CheckpointFailed, match="action boundaries"):
        full_checkpoint(sb, ck_store, 1)
    sb.execute("touch /tmp/go")
    worker.join(30)
    assert done.is_set() and ck_store.list() == []
    assert full_checkpoint(sb, ck_store, 1).step == 1


def test_runtime_criu_refuses_falls_back_only_when_allowed(make_sandbox, ck_store, docker_client):
    """Images that match the manifest but that CRIU cannot use (here: no inventory)."""
    import json

    sb = make_sandbox()
    sb.execute("echo kept > /root/file")
    ck = full_checkpoint(sb, ck_store, 1)
    manifest = json.loads((ck.path / "manifest.json").read_text())
    del manifest["files"]["runtime/inventory.img"]
    (ck.path / "runtime" / "inventory.img").unlink()
    (ck.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RestoreFailed, match="CRIU restore failed") as e:
        full_restore(ck, client=docker_client)
    assert e.value.checkpoint == ck.id
    restored = full_restore(ck, allow_degraded=True, client=docker_client)
    assert restored.degraded is True and restored.restored_from == ck.id
    assert restored.execute("cat /root/file")["output"] == "kept\n"


def test_failed_capture_reraises_from_wait_and_publishes_nothing(make_sandbox, ck_store):
    sb = make_sandbox()

    def boom(phase: str) -> None:
        if phase == "runtime_dumped":
            raise RuntimeError("injected fault")

    pending = start_checkpoint(sb, ck_store, 1, phase_hook=boom)
    with pytest.raises(CheckpointFailed, match="injected fault"):
        pending.wait(60)
    assert pending.thawed.is_set() and ck_store.list() == []
    assert not docker_client_paused(sb) and sb.execute("echo up")["output"] == "up\n"
    assert not list(ck_store.scratch_root.glob(f"{sb.name}.*")), "scratch left behind"
