"""Sandboxes without Docker's network stack (``belayer_env.host.loopback``): real containers, real CRIU.

What matters: a restored sandbox's loopback is up before its processes run (a server on
127.0.0.1 keeps answering, a connection made before the checkpoint goes on), ``localhost``
resolves, and a checkpoint is restored into a container made the way its own was (old
checkpoints keep Docker's network stack). The kill in the fence is the kernel's: once it
returns, no process is left in the container's cgroup.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_core.errors import RestoreFailed
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.host import loopback
from belayer_env.host.native import BuildError
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox import freezer
from belayer_env.sandbox.fence import kill

pytestmark = pytest.mark.skipif(not loopback.installed(), reason="CRIU loopback hook not installed "
                                "(bash scripts/setup.sh)")

# a server on 127.0.0.1 and one client connection to it, kept open across the checkpoint;
# every request on that connection gets the next number: memory + a live TCP connection
SERVER = r"""
import os, socket, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8765)); srv.listen()
n = 0
def serve():
    global n
    conn = srv.accept()[0]
    while conn.recv(1):
        n += 1; conn.sendall(b"%d\n" % n)
threading.Thread(target=serve, daemon=True).start()
cli = socket.create_connection(("localhost", 8765))
os.mkfifo("/tmp/ask")
open("/tmp/ready", "w").close()
while True:
    with open("/tmp/ask") as f:
        for _line in f:
            cli.sendall(b"x")
            with open("/tmp/answer", "a") as out:
                out.write(cli.recv(16).decode())
"""


def _start_server(sb) -> None:
    sb.execute(f"cat > /tmp/server.py <<'EOF'\n{SERVER}\nEOF")
    sb.execute("nohup python3 /tmp/server.py >/tmp/server.log 2>&1 &")
    r = sb.execute("for i in $(seq 200); do [ -e /tmp/ready ] && exit 0; sleep 0.05; done; cat /tmp/server.log; exit 1")
    assert r["returncode"] == 0, f"server did not start: {r['output']}"


def _ask(sb) -> list[str]:
    """One request over the kept connection; the answers so far."""
    r = sb.execute("count() { cat /tmp/answer 2>/dev/null | wc -l; }; n=$(count); echo x > /tmp/ask; "
                   "for i in $(seq 200); do [ $(count) -gt $n ] && exec cat /tmp/answer; sleep 0.05; done; "
                   "cat /tmp/server.log; exit 1")
    assert r["returncode"] == 0, f"no answer over the kept connection: {r['output']}"
    return r["output"].split()


def _container(sb) -> dict:
    return sb.client.api.inspect_container(sb.container_id)


def test_default_sandbox_has_no_docker_network_stack_and_resolves_localhost(make_sandbox):
    sb = make_sandbox()
    info = _container(sb)
    assert info["Config"].get("NetworkDisabled") is True
    assert info["HostConfig"]["NetworkMode"] == "none"
    assert sb.execute("ls /sys/class/net")["output"].split() == ["lo"]
    assert sb.execute("cat /sys/class/net/lo/flags")["output"].strip() == "0x9"  # IFF_UP | IFF_LOOPBACK
    assert sb.execute("getent ahosts localhost | awk '{print $1}' | sort -u")["output"].split() == ["127.0.0.1", "::1"]
    r = sb.execute("echo hacked >> /etc/hosts")
    assert r["returncode"] != 0 and "Read-only file system" in r["output"]


@pytest.mark.parametrize("docker_network_stack", [False, True], ids=["disabled", "docker-stack"])
def test_restored_loopback_is_up_and_a_live_connection_goes_on(make_sandbox, ck_store, monkeypatch,
                                                              docker_network_stack):
    if docker_network_stack:  # a sandbox made as before this change (or on a host without the hook)
        monkeypatch.setattr(loopback, "installed", lambda conf=None: False)
    sb = make_sandbox()
    monkeypatch.undo()
    assert bool(_container(sb)["Config"].get("NetworkDisabled")) is not docker_network_stack
    _start_server(sb)
    assert _ask(sb) == ["1"]
    ck = full_checkpoint(sb, ck_store)
    assert json.loads((Path(ck.path) / "manifest.json").read_text())["network_disabled"] is not docker_network_stack
    assert _ask(sb) == ["1", "2"]  # after the checkpoint: not in it
    for answers in (["1", "2"], ["1", "2", "3"]):  # a restore, then one of the restored sandbox's checkpoint
        sb = full_restore(ck, client=sb.client)
        assert bool(_container(sb)["Config"].get("NetworkDisabled")) is not docker_network_stack
        assert sb.execute("cat /sys/class/net/lo/flags")["output"].strip() == "0x9"
        assert _ask(sb) == answers  # the checkpoint's memory and connection, then one more request
        ck = full_checkpoint(sb, ck_store)


def test_restore_needing_the_hook_fails_before_touching_the_sandbox(make_sandbox, ck_store, monkeypatch):
    sb = make_sandbox()
    ck = full_checkpoint(sb, ck_store)
    monkeypatch.setattr(loopback, "installed", lambda conf=None: False)
    with pytest.raises(RestoreFailed, match="CRIU loopback hook .* scripts/setup.sh"):
        full_restore(ck, client=sb.client)
    assert sb.execute("echo alive")["output"] == "alive\n"  # never fenced


def test_loopback_up_reads_the_process_own_namespace():
    assert loopback.loopback_up(os.getpid()) is True  # the host's lo
    proc = subprocess.Popen(["unshare", "--net", "--mount", "sh", "-c",
                             "mount -t sysfs sysfs /sys && echo ready && exec sleep 60"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert loopback.loopback_up(proc.pid) is False  # a new namespace: lo down
    finally:
        proc.kill()
        proc.wait()
    assert loopback.loopback_up(2**22 + 1) is None  # no such process: cannot tell


def test_install_lists_the_hook_once_and_keeps_the_other_lines(tmp_path):
    conf = tmp_path / "runc.conf"
    conf.write_text("tcp-established\nfile-locks")  # no final newline
    loopback.install(conf)
    loopback.install(conf)
    assert conf.read_text().splitlines() == ["tcp-established", "file-locks", loopback.CONF_LINE]
    assert loopback.installed(conf)
    assert not loopback.installed(tmp_path / "missing.conf")


def test_the_installed_hook_is_the_static_one_and_does_its_job(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("no gcc: set-up installs the shell script")
    assert loopback.hook_kind() == "static", "bash scripts/setup.sh builds the static hook where gcc is"
    assert loopback.relays(), "the static hook relays Belayer's dumps too (one exec per CRIU stage)"
    loopback.check_hook(loopback.HOOK_PATH)  # nothing at another stage; lo up at setup-namespaces
    for action, pid in (("setup-namespaces", "12x"), ("setup-namespaces", str(2**22 + 1))):
        r = subprocess.run([str(loopback.HOOK_PATH)], env={"CRTOOLS_SCRIPT_ACTION": action, "CRTOOLS_INIT_PID": pid},
                           capture_output=True, text=True)
        assert r.returncode != 0 and "belayer-criu-loopback" in r.stderr, (pid, r)


@pytest.mark.parametrize("body, why", [("exit 0", "lo is not up"),
                                       ('exec nsenter --net="/proc/$CRTOOLS_INIT_PID/ns/net" ip link set lo up',
                                        "did something at another stage")])
def test_check_hook_refuses_a_hook_that_does_not_do_its_job(tmp_path, body, why):
    hook = tmp_path / "hook"
    hook.write_text(f"#!/bin/sh\nPATH=/usr/sbin:/usr/bin:/sbin:/bin\n{body}\n")
    with pytest.raises(BuildError, match=why):
        loopback.check_hook(hook)
    script = tmp_path / "script"
    script.write_text(loopback.HOOK_SCRIPT)
    loopback.check_hook(script)  # the fallback does its job too


def test_fence_kills_through_the_kernel_and_leaves_no_process(make_sandbox):
    sb = make_sandbox()
    sb.execute("nohup sh -c 'while :; do date >> /tmp/log; done' >/dev/null 2>&1 &")
    info = _container(sb)
    procs = freezer.control_file(sb.container_id).parent / "cgroup.procs"
    assert len(procs.read_text().split()) >= 2
    assert not freezer.kill_all(sb.container_id, os.getpid())  # not one of its processes: nothing done
    assert sb.is_alive()
    fenced = kill(sb.client, sb.name)
    assert fenced == [sb.container_id]
    assert not procs.exists() or procs.read_text().split() == []
    stat = Path(f"/proc/{info['State']['Pid']}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
