"""A checkpointer that dies mid-dump leaves nothing behind that waits on a bare pid number
(issue 36, item 9): the orphan-thaw helper holds CRIU by a pidfd, so once CRIU has exited
it is seen gone even when its pid already belongs to a new process (pid reuse, made
deterministic here with ``ns_last_pid``); the cgroup is thawed and no helper is left. Real
container, real runc and CRIU, the dump held at known points (a CRIU action script, runc
stopped so that CRIU waits on it, the helper stopped while the pid changes hands)."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from belayer_core.procfs import processes, read_stat, session_members
from belayer_env.sandbox import freezer
from tests.belayer_env.conftest_checkpoint import HOLD_SCRIPT, CriuHold, init_pid
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


class _Hold(CriuHold):
    """``CriuHold`` at any action-script stage."""

    def __init__(self, root: Path, action: str):
        root.mkdir(mode=0o700)
        self.root, self.action = root, action
        self.script = root / "hold.sh"
        self.script.write_text(HOLD_SCRIPT.format(action=action, dir=shlex.quote(str(root))))
        self.script.chmod(0o700)


def dump_orphaned_at_network_unlock(sb, tmp_path: Path) -> tuple[int, int]:
    """A checkpointer process whose dump is held at post-dump (after the checkpointer's own
    post-dump script answered), is SIGKILLed there; CRIU, let go, runs its network-unlock
    scripts (Belayer's first: it finds the checkpointer gone and starts the orphan thaw)
    and is held again. Returns (CRIU's pid, runc's pid), CRIU stopped."""
    # CRIU runs a stage's scripts newest first: the checkpointer's own, then these
    first, second = _Hold(tmp_path / "hold1", "post-dump"), _Hold(tmp_path / "hold2", "network-unlock")
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "BELAYER_CRIU_EXTRA_CONFIG": f"action-script {first.script}\naction-script {second.script}"}
    proc = subprocess.Popen([sys.executable, "-c", CHECKPOINTER, sb.container_id, sb.name, str(tmp_path / "store")],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        criu = first.wait(init_pid(sb), dumping=lambda: proc.poll() is None)
    finally:
        proc.kill()
        proc.wait()
    os.kill(criu, signal.SIGCONT)
    assert second.wait(init_pid(sb), dumping=lambda: read_stat(criu) is not None) == criu
    stat = read_stat(criu)
    assert stat is not None and stat.comm == "criu"
    return criu, stat.ppid


def _gone_or_zombie(pid: int) -> bool:
    stat = read_stat(pid)
    return stat is None or stat.state in "ZX"


def _children(pid: int) -> list[int]:
    return [p.pid for p in processes() if p.ppid == pid]


def _take_pid(pid: int, attempts: int = 50) -> subprocess.Popen | None:
    """A new process with the number ``pid`` (free now): what the kernel does to a freed pid
    sooner or later, here at once (``ns_last_pid``)."""
    for _ in range(attempts):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(["sleep", "1000"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
        if read_stat(pid) is not None:
            return None  # taken by another process meanwhile
    return None


def test_an_orphaned_helper_never_waits_on_a_reused_pid(make_sandbox, tmp_path):
    sb = make_sandbox()
    criu, runc = dump_orphaned_at_network_unlock(sb, tmp_path)
    assert read_stat(runc).comm == "runc"
    stopped: list[int] = []
    reuse = None
    try:
        # the dump's other processes, but CRIU's own children (an action script still exiting)
        helpers_of = lambda: [p for p in session_members(runc) if p not in (runc, criu, *_children(criu))]  # noqa: E731
        wait_until(helpers_of, 30, "the orphan-thaw helper started")
        stopped = helpers_of()
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        os.kill(criu, signal.SIGCONT)  # CRIU ends, runc reaps it and exits
        wait_until(lambda: read_stat(criu) is None, 60, "CRIU exited and was reaped")
        reuse = _take_pid(criu)
        assert reuse is not None, f"could not hand pid {criu} to a new process"
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: not [p for p in session_members(runc) if p != reuse.pid], 30,
                   f"the dump's helpers gone although pid {criu} is alive again (a new process)")
        wait_until(lambda: not freezer.is_frozen(sb.container_id), 30, "the container thawed")
    finally:
        for pid in [runc, criu, *stopped]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if reuse is not None:
            reuse.kill()
            reuse.wait()
    assert sb.execute("echo alive")["output"] == "alive\n"
