"""A checkpoint interrupted anywhere publishes nothing and older checkpoints still restore.

Real faults: SIGKILL of the checkpointing process at chosen phases, SIGKILL of CRIU in the
middle of its dump, and a full disk (a small tmpfs store).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from belayer.errors import CheckpointFailed
from belayer_env.checkpoint import CheckpointStore, full_checkpoint, full_restore
from tests.belayer_env.conftest_checkpoint import log_state, start_counter
from tests.conftest import wait_until

KILL_AT = """
import os, signal, sys
from belayer_env.checkpoint import CheckpointStore, full_checkpoint
from belayer_env.config import SandboxConfig
from belayer_env.sandbox import DockerSandbox
cid, name, store, phase = sys.argv[1:5]
sb = DockerSandbox.attach(cid, SandboxConfig(), name)
def hook(p):
    if p == phase:
        os.kill(os.getpid(), signal.SIGKILL)
full_checkpoint(sb, CheckpointStore(store), 2, phase_hook=hook)
"""


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


def _kill_criu_of(container_id: str, stop: threading.Event, killed: list[int]) -> None:
    """Poll /proc for the criu child of `runc checkpoint ... <container_id>`; SIGKILL it."""
    while not stop.is_set() and not killed:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                if comm != "criu":
                    continue
                ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
                parent = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError):
                continue
            if b"checkpoint" in parent and container_id.encode() in parent:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                return


def test_sigkill_of_criu_publishes_nothing(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    start_counter(sb)
    sb.execute("echo first > /root/state")
    first = full_checkpoint(sb, ck_store, 1)
    # 300 MiB of touched memory: the dump lasts long enough to be caught mid-way
    sb.execute("setsid python3 -c 'import time; b = bytearray(300 << 20); b[::4096] = b\"x\" * len(b[::4096]); open(\"/tmp/big.ready\", \"w\").close(); "
               "time.sleep(1e6)' >/dev/null 2>&1 </dev/null &")
    wait_until(lambda: sb.execute("test -e /tmp/big.ready")["returncode"] == 0, 30, "300 MiB process ready")
    stop, killed = threading.Event(), []

    def hook(phase: str) -> None:
        if phase == "frozen":
            threading.Thread(target=_kill_criu_of, args=(sb.container_id, stop, killed), daemon=True).start()

    try:
        with pytest.raises(CheckpointFailed):
            full_checkpoint(sb, ck_store, 2, phase_hook=hook)
    finally:
        stop.set()
    assert killed, "criu was never seen running (dump too fast to interrupt?)"
    assert [c.id for c in ck_store.list()] == [first.id]
    assert not list((ck_store.path / ".staging").iterdir())
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
    with pytest.raises(CheckpointFailed, match="No space left"):
        full_checkpoint(sb, small_store, 2)
    assert [c.id for c in small_store.list()] == [first.id]
    assert not list((small_store.path / ".staging").iterdir())
    _restores_first(first, docker_client, "first\n")
