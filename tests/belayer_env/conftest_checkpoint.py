"""Fixtures for checkpoint/restore tests: real containers, real CRIU, cleanup by name."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from belayer.procfs import read_stat
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

# 300 MiB of touched memory: a dump lasts long enough to be caught mid-way
BIG_PROCESS = ("setsid python3 -c 'import time; b = bytearray(300 << 20); b[::4096] = b\"x\" * len(b[::4096]); "
               "open(\"/tmp/big.ready\", \"w\").close(); time.sleep(1e6)' >/dev/null 2>&1 </dev/null &"
               " while [ ! -e /tmp/big.ready ]; do sleep 0.05; done")

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
    from belayer_env.checkpoint import CheckpointStore

    return CheckpointStore(tmp_path / "store")


@pytest.fixture
def make_sandbox(docker_client):
    """Factory of sandboxes with the test programs; every container of theirs is fenced at exit."""
    from belayer_env import DockerSandbox
    from belayer_env.checkpoint import fence, runtime

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


def signal_criu_of(container_id: str, sig: int, stop: threading.Event, hit: list[int]) -> None:
    """Poll /proc for the criu child of `runc checkpoint ... <container_id>` and send it ``sig``
    (a real fault in the middle of a real dump); its pid goes to ``hit``."""
    while not stop.is_set() and not hit:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            proc = read_stat(int(pid))
            if proc is None or proc.comm != "criu":
                continue
            try:
                parent = Path(f"/proc/{proc.ppid}/cmdline").read_bytes().split(b"\0")
                if b"checkpoint" in parent and container_id.encode() in parent:
                    os.kill(proc.pid, sig)
            except (OSError, ProcessLookupError):
                continue  # it ended meanwhile
            if b"checkpoint" in parent and container_id.encode() in parent:
                hit.append(proc.pid)
                return


def criu_signaller(container_id: str, sig: int, hit: list[int], stop: threading.Event, then=None):
    """A phase hook: when the capture freezes, start ``signal_criu_of`` (then call ``then()``)."""

    def watch() -> None:
        signal_criu_of(container_id, sig, stop, hit)
        if hit and then is not None:
            then()

    def hook(phase: str) -> None:
        if phase == "frozen" and not stop.is_set():
            threading.Thread(target=watch, daemon=True).start()

    return hook

