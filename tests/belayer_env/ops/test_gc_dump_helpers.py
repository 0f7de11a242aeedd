"""``belayer gc`` ends what a dead checkpointer's dump left running (issue 36, item 9): runc
and CRIU (here held mid-dump, the container seized), found by the marker every dump gives
its processes, and thaws the cgroup the dump had frozen. Real container, runc and CRIU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from belayer_core.procfs import read_stat
from belayer_env.ops.gc import dump_helpers, end_dump_helpers
from belayer_env.sandbox import freezer
from tests.belayer_env.conftest_checkpoint import CriuHold, init_pid
from tests.conftest import wait_until

REPO = Path(__file__).resolve().parents[3]
CHECKPOINTER = """
import sys
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
from belayer_env.store.store import CheckpointStore
cid, name, store = sys.argv[1:4]
full_checkpoint(DockerSandbox.attach(cid, SandboxConfig(), name), CheckpointStore(store), 1)
"""


def _alive(pid: int) -> bool:
    stat = read_stat(pid)
    return stat is not None and stat.running


def test_gc_ends_the_dump_helpers_of_a_dead_checkpointer(make_sandbox, tmp_path):
    sb = make_sandbox()
    hold = CriuHold(tmp_path / "hold", "post-dump")
    env = {**os.environ, "PYTHONPATH": str(REPO), "BELAYER_CRIU_EXTRA_CONFIG": f"action-script {hold.script}"}
    proc = subprocess.Popen([sys.executable, "-c", CHECKPOINTER, sb.container_id, sb.name, str(tmp_path / "store")],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    criu = None
    try:
        criu = hold.wait(init_pid(sb), dumping=lambda: proc.poll() is None)
        runc = read_stat(criu).ppid
        mine = [h for h in dump_helpers() if h.container == sb.container_id]
        assert mine == []  # its checkpointer still runs: not gc's business
        proc.kill()
        proc.wait()

        mine = [h for h in dump_helpers() if h.container == sb.container_id]
        assert {criu, runc} <= {h.pid for h in mine}
        dry = subprocess.run([sys.executable, "-m", "belayer", "gc", "--dry-run", "--json"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        listed = {h["pid"] for h in json.loads(dry.stdout)["dump_helpers"] if h["container"] == sb.container_id}
        assert {criu, runc} <= listed and _alive(criu)  # a dry run ends nothing

        ended = end_dump_helpers(mine)
        assert {criu, runc} <= set(ended)
        wait_until(lambda: not _alive(criu) and not _alive(runc), 30, "CRIU and runc ended")
        assert not [h for h in dump_helpers() if h.container == sb.container_id]
        assert not freezer.is_frozen(sb.container_id)
        assert sb.execute("echo alive")["output"] == "alive\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if criu is not None and _alive(criu):
            os.kill(criu, signal.SIGKILL)
