"""A checkpoint interrupted anywhere publishes nothing and older checkpoints still restore.

Real faults: SIGKILL of the checkpointing process at chosen phases, SIGKILL of CRIU in the
middle of its dump (held there by its own action script, see ``CriuHold``), and a full disk
(a small tmpfs store).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from belayer_core.errors import CheckpointFailed
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.criu import runtime
from belayer_env.restore.restore import full_restore
from belayer_env.store.store import CheckpointStore
from tests.belayer_env.conftest_checkpoint import (
    HOLD_ACTIONS,
    KILL_AT,
    CriuHold,
    init_pid,
    log_state,
    start_counter,
)
from tests.conftest import process_alive, wait_until

HUNG_TIMEOUT_S = 10.0
"""Dump timeout of the hung-dump test: it must outlast runc + CRIU reaching the hold even
under heavy load (measured 0.4 s from the checkpoint call to the hold at load 18 on 2 cores)."""



def _restores_first(ck, docker_client, expect: str) -> None:
    restored = full_restore(ck, client=docker_client)
    assert restored.execute("cat /root/state")["output"] == expect
    wait_until(lambda: log_state(restored)[1] and log_state(restored)[0] > 0, 30, "restored counter consistent")


@pytest.mark.parametrize("phase", ["runtime_dumped", "layer_captured", "written"])
def test_sigkill_of_checkpointer_publishes_nothing(phase, make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    start_counter(sb)
    sb.execute("echo first > /root/state")
    first = full_checkpoint(sb, ck_store, 1)
    sb.execute("echo second > /root/state")
    p = subprocess.run([sys.executable, "-c", KILL_AT, sb.container_id, sb.name, str(ck_store.path), phase],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert [c.id for c in ck_store.list()] == [first.id]
    assert ck_store.clean_incomplete(), "the killed writer left no staging/scratch to clean"
    assert not list((ck_store.path / ".staging").iterdir())
    # killed while frozen leaves the container paused: the next checkpoint copes
    again = full_checkpoint(sb, ck_store, 3)
    assert sb.execute("cat /root/state")["output"] == "second\n"
    assert [c.step for c in ck_store.list(sb.name)] == [1, 3]
    ck_store.remove(again.id)
    _restores_first(first, docker_client, "first\n")


def _dump_caught_mid_way(sb, ck_store, arm: Callable[[], CriuHold], sig: int | None) -> tuple:
    """Checkpoint 1, then checkpoint 2 with CRIU held mid-dump (by the hold ``arm()`` returns)
    and sent ``sig`` there (None: left stopped); checkpoint 2 must fail and publish nothing."""
    start_counter(sb)
    sb.execute("echo first > /root/state")
    first = full_checkpoint(sb, ck_store, 1)
    hold = arm()
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(full_checkpoint, sb, ck_store, 2)
        criu_pid = hold.wait(init_pid(sb), dumping=lambda: not second.done())
        if sig is not None:
            os.kill(criu_pid, sig)
        with pytest.raises(CheckpointFailed) as failed:
            second.result()
    assert [c.id for c in ck_store.list()] == [first.id]
    assert not list((ck_store.path / ".staging").iterdir())
    return first, criu_pid, failed.value


@pytest.mark.parametrize("stage", HOLD_ACTIONS)
def test_sigkill_of_criu_publishes_nothing(stage, make_sandbox, ck_store, criu_hold, docker_client):
    """CRIU SIGKILLed with the container's processes seized: before any task is dumped
    (network-lock) and with every image written but the dump not yet reported (post-dump)."""
    sb = make_sandbox()
    first, criu_pid, err = _dump_caught_mid_way(sb, ck_store, lambda: criu_hold(stage), signal.SIGKILL)
    assert "runc checkpoint failed" in str(err), err
    wait_until(lambda: not process_alive(criu_pid), 30, f"killed criu {criu_pid} reaped")
    # CRIU had thawed the cgroup to seize the processes: Docker's unpause worked all the same
    # (the capture froze it again first) and the sandbox runs on, its counter intact
    n, _ok = log_state(sb)
    wait_until(lambda: log_state(sb)[0] > n, 30, "the counter counting on after the failed dump")
    assert log_state(sb)[1], "the counter's log lost or repeated a line"
    _restores_first(first, docker_client, "first\n")


def test_hung_criu_dump_is_killed_at_its_timeout(make_sandbox, ck_store, criu_hold, docker_client, monkeypatch):
    """A CRIU that never returns (stopped mid-dump) is killed with runc at the dump timeout:
    the checkpoint fails naming it, no dump process is left, older checkpoints restore."""

    def arm() -> CriuHold:
        monkeypatch.setattr(runtime, "DUMP_TIMEOUT_S", HUNG_TIMEOUT_S)  # checkpoint 2 only
        return criu_hold()

    sb = make_sandbox()
    first, criu_pid, err = _dump_caught_mid_way(sb, ck_store, arm, None)
    assert f"timed out after {HUNG_TIMEOUT_S:g} s" in str(err) and "killed" in str(err), err
    wait_until(lambda: not process_alive(criu_pid), 30, f"stopped criu {criu_pid} killed and reaped")
    sb.close()  # the container is not held by a dump any more: it can be removed
    _restores_first(first, docker_client, "first\n")


@pytest.fixture
def small_store(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {r.stderr.strip()}")
    yield CheckpointStore(mnt / "store")
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_publishes_nothing(make_sandbox, small_store, docker_client):
    sb = make_sandbox()
    start_counter(sb)
    sb.execute("echo first > /root/state")
    first = full_checkpoint(sb, small_store, 1)
    sb.execute("head -c 20000000 /dev/urandom > /root/big")
    with pytest.raises(CheckpointFailed, match="No space left|not enough space in the checkpoint store"):
        full_checkpoint(sb, small_store, 2)
    assert [c.id for c in small_store.list()] == [first.id]
    assert not list((small_store.path / ".staging").iterdir())
    _restores_first(first, docker_client, "first\n")
