"""Pre-staged restores: same result as the plain path, never from a partial or stale copy.

Real containers and CRIU. Faults: SIGKILL of a child process pre-staging at chosen phases,
a phase hook that raises, an older checkpoint's copy, a manifest changed after staging.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.capture.pending import start_checkpoint
from belayer_env.restore.prestaging import FILLING, docker_tmp, prestage, staged_copies
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox.treehash import tree_hash
from belayer_env.store.store import owner_tag
from tests.belayer_env.capture.test_checkpoint import EXCLUDE, FS_CHANGES
from tests.belayer_env.conftest_checkpoint import http_get, log_state, start_counter, start_server
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[3]

KILL_AT = """
import os, signal, sys
from belayer_env.store.store import CheckpointStore
from belayer_env.restore.prestaging import prestage
store, ck_id, phase = sys.argv[1:4]
def hook(p):
    if p == phase:
        os.kill(os.getpid(), signal.SIGKILL)
prestage(CheckpointStore(store).get(ck_id), phase_hook=hook)
"""


def restore(ck, client) -> tuple[object, list[str]]:
    phases: list[str] = []
    return full_restore(ck, client=client, phase_hook=phases.append), phases


def copies_of(client, ck) -> list[Path]:
    return [d for d in staged_copies(client, ck.sandbox) if ck.id in d.name]


def test_prestaged_restore_equals_plain_restore(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    assert sb.execute(FS_CHANGES)["returncode"] == 0
    start_counter(sb, heap_mib=20)
    start_server(sb, 8000)
    before = tree_hash(sb, exclude=EXCLUDE)
    hits = http_get(sb, 8000)
    ck = full_checkpoint(sb, ck_store, 1)
    logged = log_state(sb)[0]

    staged = prestage(ck, docker_client)
    assert staged is not None and copies_of(docker_client, ck) == [staged]
    assert json.loads((staged / "staged.json").read_text())["id"] == ck.id
    fast, phases = restore(ck, docker_client)
    assert "staged" in phases, phases
    assert not staged.exists() and copies_of(docker_client, ck) == [], "a staged copy is consumed by use"
    assert fast.restored_from == ck.id and fast.degraded is False
    assert tree_hash(fast, exclude=EXCLUDE) == before
    wait_until(lambda: log_state(fast)[0] > logged + 5, 30, "restored counter to keep logging")
    assert log_state(fast)[1], "append-mode log has a duplicated or missing line"
    assert http_get(fast, 8000) == hits + 1

    plain, phases = restore(ck, docker_client)  # nothing staged any more: the unpacking path
    assert "staged" not in phases, phases
    assert tree_hash(plain, exclude=EXCLUDE) == before
    wait_until(lambda: log_state(plain)[0] > logged + 5, 30, "restored counter to keep logging")
    assert log_state(plain)[1] and http_get(plain, 8000) == hits + 1


def test_start_checkpoint_prestages_only_the_newest(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    sb.execute("echo one > /root/state")
    first = start_checkpoint(sb, ck_store, 1)
    ck1 = first.wait(60)
    assert first.prestaged.wait(120)
    assert len(copies_of(docker_client, ck1)) == 1 and staged_copies(docker_client, sb.name) == copies_of(docker_client, ck1)
    sb.execute("echo two > /root/state")
    second = start_checkpoint(sb, ck_store, 2)
    ck2 = second.wait(60)
    restored, phases = restore(ck2, docker_client)  # waits for the pre-staging in flight, uses it
    assert "staged" in phases and second.prestaged.wait(60)
    assert restored.execute("cat /root/state")["output"] == "two\n"
    assert staged_copies(docker_client, sb.name) == [], "the older copy is removed once a newer one is staged"
    off = start_checkpoint(restored, ck_store, 3, prestage=False)
    assert off.wait(60) is not None and off.prestaged.is_set()
    assert staged_copies(docker_client, sb.name) == []


@pytest.mark.parametrize("phase", ["layer_unpacked", "images_verified", "staged"])
def test_sigkilled_prestage_is_never_used(phase, make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    start_counter(sb)
    sb.execute("echo kept > /root/state")
    ck = full_checkpoint(sb, ck_store, 1)
    p = subprocess.Popen([sys.executable, "-c", KILL_AT, str(ck_store.path), ck.id, phase],
                         stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, err[-2000:]
    left = list(docker_tmp(docker_client).glob(f"{FILLING}*~{p.pid}-*")) + copies_of(docker_client, ck)
    assert left, "the killed prestage left nothing behind to test with"
    restored, phases = restore(ck, docker_client)
    assert "staged" not in phases, "a copy whose writer died was used"
    assert not any(d.exists() for d in left), "what the dead prestage left was not cleaned"
    assert restored.execute("cat /root/state")["output"] == "kept\n"
    wait_until(lambda: log_state(restored)[1] and log_state(restored)[0] > 0, 30, "restored counter consistent")


def test_prestage_whose_hook_raises_leaves_nothing(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    sb.execute("echo kept > /root/state")
    ck = full_checkpoint(sb, ck_store, 1)

    def boom(p: str) -> None:
        if p == "images_verified":
            raise RuntimeError("injected fault")

    with pytest.raises(RuntimeError, match="injected"):
        prestage(ck, docker_client, phase_hook=boom)
    assert not list(docker_tmp(docker_client).glob(f"{FILLING}*~{owner_tag()}")), "partial copy left"
    assert copies_of(docker_client, ck) == []
    restored, phases = restore(ck, docker_client)
    assert "staged" not in phases and restored.execute("cat /root/state")["output"] == "kept\n"


def test_stale_or_mismatched_copy_is_not_used(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    sb.execute("echo one > /root/state")
    ck1 = full_checkpoint(sb, ck_store, 1)
    assert prestage(ck1, docker_client) is not None
    sb.execute("echo two > /root/state")
    ck2 = full_checkpoint(sb, ck_store, 2)

    restored, phases = restore(ck2, docker_client)  # only ck1 is staged: not this one's
    assert "staged" not in phases and restored.execute("cat /root/state")["output"] == "two\n"
    assert len(copies_of(docker_client, ck1)) == 1, "an other checkpoint's restore took ck1's copy"

    # the checkpoint's manifest no longer is the one the copy was verified against
    manifest = ck1.path / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "note": "rewritten"}))
    restored, phases = restore(ck1, docker_client)
    assert "staged" not in phases, "a copy staged against another manifest was used"
    assert copies_of(docker_client, ck1) == [], "the mismatched copy is discarded"
    assert restored.execute("cat /root/state")["output"] == "one\n"

    assert prestage(ck1, docker_client) is not None  # staged against the current manifest: used
    restored, phases = restore(ck1, docker_client)
    assert "staged" in phases and restored.execute("cat /root/state")["output"] == "one\n"


def test_copy_of_a_removed_checkpoint_is_dropped(make_sandbox, ck_store, docker_client):
    a, b = make_sandbox(), make_sandbox()
    cka = full_checkpoint(a, ck_store, 1)
    assert prestage(cka, docker_client) is not None
    ck_store.remove(cka.id)
    ckb = full_checkpoint(b, ck_store, 1)
    assert prestage(ckb, docker_client) is not None  # another sandbox's prestage tidies up
    assert copies_of(docker_client, cka) == [] and len(copies_of(docker_client, ckb)) == 1


def test_clean_up_unmounts_a_dead_prestage_in_memory_unpack(docker_client):
    """A prestage killed while its unpacked tree sat on its tmpfs (``work/fsroot``) leaves a
    mount below its dir: the next clean-up unmounts it and removes the dir."""
    from belayer_env.restore.prestaging import clean_dead_staging

    tmp = docker_tmp(docker_client)
    dead = tmp / f"{FILLING}deadbeef0000~{2**22 + 7}-1"  # an owner that is not alive
    (dead / "fsroot").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "belayer-test", str(dead / "fsroot")], check=True)
    (dead / "fsroot" / "f").write_text("unpacked")
    clean_dead_staging(tmp)
    assert str(dead) not in Path("/proc/self/mounts").read_text(), "the tmpfs stayed mounted"
    assert not dead.exists()
