"""Fixtures for checkpoint/restore tests: real containers, real CRIU, cleanup by name."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from belayer_core.procfs import read_stat
from tests.conftest import wait_until

COUNTER = r'''
import os, sys, time
heap = bytearray(int(sys.argv[2]) << 20)  # in-memory state CRIU must carry
n = 0
log = open(sys.argv[1], "a")  # append mode: restore must neither repeat nor skip a line
while True:
    n += 1
    log.write(f"{n}\n")
    log.flush()
    time.sleep(0.01)
'''

SERVER = r'''
import http.server, sys
hits = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global hits
        hits += 1
        body = str(hits).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):  # silent: its stdout may be the exec's pipe (see docs)
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''

LOCKER = r'''
import fcntl, sys, time
f = open(sys.argv[1], "w")
fcntl.flock(f, fcntl.LOCK_EX)
open(sys.argv[1] + ".held", "w").close()
while True:
    time.sleep(1)
'''

TCP_PAIR = r'''
import os, socket, sys, time
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
cli = socket.create_connection(srv.getsockname())
peer, _ = srv.accept()  # one established connection, both ends in this process
n = 0
while True:
    n += 1
    cli.sendall(f"{n:08d}".encode())
    got = int(peer.recv(8))
    assert got == n, (got, n)
    with open(sys.argv[1] + ".new", "w") as f:
        f.write(str(got))
    os.replace(sys.argv[1] + ".new", sys.argv[1])  # readers never see a half-written file
    time.sleep(0.01)
'''

GET = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/', timeout=5).read().decode())\""
TRY_LOCK = ("python3 -c \"import fcntl,sys; f=open('{path}','a');\n"
            "try: fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
            "except BlockingIOError: print('held')\"")
CHECK_LOG = ("python3 -c \"l=[int(x) for x in open('{path}')]; "
             "print(len(l), l==list(range(1, len(l)+1)))\"")


def install_programs(sb) -> None:
    for name, src in (("counter.py", COUNTER), ("server.py", SERVER), ("locker.py", LOCKER), ("tcp_pair.py", TCP_PAIR)):
        r = sb.execute(f"mkdir -p /opt/t && cat > /opt/t/{name} <<'EOF'\n{src}\nEOF")
        assert r["returncode"] == 0, r


def start_counter(sb, log="/tmp/count.log", heap_mib=1) -> None:
    sb.execute(f"setsid python3 /opt/t/counter.py {log} {heap_mib} >/dev/null 2>&1 </dev/null &")
    wait_until(lambda: int(sb.execute(f"cat {log} 2>/dev/null | wc -l")["output"].strip() or 0) > 3,
               30, f"counter writing {log}")


def start_server(sb, port=8000, redirect=True) -> None:
    tail = " >/dev/null 2>&1 </dev/null" if redirect else ""  # without: logs into the command's output file
    sb.execute(f"python3 /opt/t/server.py {port}{tail} &")
    wait_until(lambda: sb.execute(GET.format(port=port))["returncode"] == 0, 30, f"server on :{port}")


def http_get(sb, port=8000) -> int:
    r = sb.execute(GET.format(port=port))
    assert r["returncode"] == 0, f"server on :{port} does not answer: {r['output'][-300:]}"
    return int(r["output"].strip())


def log_state(sb, path="/tmp/count.log") -> tuple[int, bool]:
    n, ok = sb.execute(CHECK_LOG.format(path=path))["output"].split()
    return int(n), ok == "True"


@pytest.fixture
def ck_store(tmp_path):
    from belayer_env.store.store import CheckpointStore

    return CheckpointStore(tmp_path / "store")


@pytest.fixture
def make_sandbox(docker_client):
    """Factory of sandboxes with the test programs; every container of theirs is fenced at exit."""
    from belayer_env import DockerSandbox
    from belayer_env.criu import runtime
    from belayer_env.sandbox.fence import fence

    if why := runtime.available():
        pytest.skip(f"CRIU checkpoints unavailable: {why}")
    names = []

    def make(**kw):
        sb = DockerSandbox(client=docker_client, **kw)
        names.append(sb.name)
        install_programs(sb)
        return sb

    yield make
    for name in names:
        fence(docker_client, name, background=False)


HOLD_ACTIONS = ("network-lock", "post-dump")
"""CRIU action-script stages of a dump that come after CRIU seized the container's processes:
network-lock before any task is dumped, post-dump after every image is written."""

HOLD_SCRIPT = """#!/bin/sh
# test-only CRIU action script: stop CRIU itself ($PPID) at its first {action} stage
[ "$CRTOOLS_SCRIPT_ACTION" = {action} ] || exit 0
mkdir {dir}/claimed 2>/dev/null || exit 0  # one hold only: later dumps run through
echo "$PPID" > {dir}/criu.pid.new && mv {dir}/criu.pid.new {dir}/criu.pid
kill -STOP "$PPID"
"""


class CriuHold:
    """The next CRIU dump stops itself at an action-script stage (a real ``runc checkpoint``,
    its real CRIU, held SIGSTOPped with the container's processes seized) until the test
    signals it: a fault at a known point of the dump instead of a race with a poller.

    CRIU runs action scripts synchronously (criu/action-scripts.c, also from a config file
    in RPC mode, which runc uses); the script's parent is the dumping CRIU.
    """

    def __init__(self, root: Path, action: str):
        if action not in HOLD_ACTIONS:
            raise ValueError(f"hold at one of {HOLD_ACTIONS}, not {action!r}")
        root.mkdir(mode=0o700)
        self.root, self.action = root, action
        self.script = root / "hold.sh"
        self.script.write_text(HOLD_SCRIPT.format(action=action, dir=shlex.quote(str(root))))
        self.script.chmod(0o700)

    def wait(self, container_pid: int, dumping: Callable[[], bool], timeout: float = 60) -> int:
        """Wait until CRIU stopped itself at the hold, while ``dumping()``; its pid. Checks
        that this CRIU has seized ``container_pid`` (the container's init): mid-dump."""

        def held() -> int | str | None:
            try:
                pid = int((self.root / "criu.pid").read_text())
            except (OSError, ValueError):
                return None if dumping() else "ended"
            stat = read_stat(pid)
            return pid if stat is not None and stat.comm == "criu" and stat.state == "T" else None

        pid = wait_until(held, timeout, f"CRIU stopped at its {self.action} action script")
        assert pid != "ended", f"the dump ended before CRIU reached its {self.action} action script"
        assert tracer_of(container_pid) == pid, f"the held CRIU {pid} has not seized the container's init"
        return pid


def tracer_of(pid: int) -> int | None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("TracerPid:"):
            return int(line.split()[1])
    return None


def init_pid(sb) -> int:
    """Host pid of the sandbox container's init."""
    return sb.client.api.inspect_container(sb.container_id)["State"]["Pid"]


@pytest.fixture
def criu_hold(tmp_path, monkeypatch):
    """Arm a ``CriuHold`` for this test's next dump: ``hold = criu_hold("network-lock")``."""
    from belayer_env.criu import runtime

    n = []

    def arm(action: str = "network-lock") -> CriuHold:
        n.append(1)
        hold = CriuHold(tmp_path / f"criu-hold-{len(n)}", action)
        monkeypatch.setattr(runtime, "CRIU_EXTRA_CONFIG", f"action-script {hold.script}")
        return hold

    return arm


# A checkpointer process SIGKILLed at a capture phase: argv = container id, sandbox name,
# store path, phase.
KILL_AT = """
import os, signal, sys
from belayer_env.store.store import CheckpointStore
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.sandbox.config import SandboxConfig
from belayer_env.sandbox.container import DockerSandbox
cid, name, store, phase = sys.argv[1:5]
sb = DockerSandbox.attach(cid, SandboxConfig(), name)
def hook(p):
    if p == phase:
        os.kill(os.getpid(), signal.SIGKILL)
full_checkpoint(sb, CheckpointStore(store), 2, phase_hook=hook)
"""
