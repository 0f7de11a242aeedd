"""DockerSandbox against a real engine: semantics, limits, and infra failures raised not returned."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from belayer_core.errors import (
    ConfigError,
    DaemonUnavailable,
    InvalidAction,
    SandboxLost,
    UsageError,
)
from belayer_env import DockerSandbox, SandboxConfig
from belayer_env.sandbox.command import RESERVED_PIDS
from belayer_env.sandbox.output import TRUNCATION_MARKER
from tests.conftest import wait_until


def test_output_returncode_merged_streams(sandbox):
    r = sandbox.execute("echo out; echo err >&2; exit 3")
    assert r == {"output": "out\nerr\n", "returncode": 3}


def test_cwd_and_env(docker_client):
    with DockerSandbox(client=docker_client, cwd="/tmp", env={"GREETING": "hello world"}) as sb:
        assert sb.execute("pwd; echo $GREETING")["output"] == "/tmp\nhello world\n"
        assert sb.execute("pwd", cwd="/usr")["output"] == "/usr\n"
        # a login shell: the profile runs, PATH is the usual one
        assert sb.execute("command -v python3")["output"].strip() == "/usr/bin/python3"


def test_timeout_kills_command_not_container(sandbox):
    r = sandbox.execute("echo started; sleep 300 & sleep 300", timeout=1)
    assert r["timed_out"] is True and r["returncode"] in (124, 137)
    assert r["output"].startswith("started\n") and "timed out after 1 s" in r["output"]
    # the command's whole process group is gone; the container still serves commands
    ps = sandbox.execute("ps -eo args")["output"]
    assert "sleep 300" not in ps, ps
    assert sandbox.execute("echo alive")["output"] == "alive\n"


def test_truncation_keeps_head_and_tail(docker_client):
    with DockerSandbox(client=docker_client, max_output_bytes=1000) as sb:
        r = sb.execute("echo BEGIN; head -c 50000 /dev/zero | tr '\\0' x; echo; echo END")
    out = r["output"]
    assert r["returncode"] == 0
    assert out.startswith("BEGIN\n") and out.endswith("END\n")
    marker = TRUNCATION_MARKER.split("{")[0]
    assert marker in out and "bytes omitted" in out
    assert len(out) < 1200


def test_invalid_utf8_is_replaced(sandbox):
    r = sandbox.execute(r"printf 'ok\377\376end'")
    assert r["output"] == "ok\ufffd\ufffdend"


def test_background_job_holding_stdout_does_not_hang(sandbox):
    r = sandbox.execute("sleep 60 & echo launched", timeout=30)
    assert r == {"output": "launched\n", "returncode": 0}


def test_container_killed_during_command_raises(sandbox, docker_client):
    result: dict = {}

    def run():
        try:
            result["value"] = sandbox.execute("sleep 120")
        except BaseException as e:  # noqa: BLE001 - inspected below
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: "sleep 120" in str(docker_client.api.top(sandbox.container_id)), 20,
               "the command to start inside the container")
    docker_client.api.kill(sandbox.container_id)
    t.join(60)
    assert not t.is_alive(), "execute did not return after the container was killed"
    assert "value" not in result, f"an infra failure was returned as an observation: {result}"
    assert isinstance(result["error"], SandboxLost), result
    with pytest.raises(SandboxLost):
        sandbox.execute("echo again")


def test_removed_container_raises_sandbox_lost(sandbox, docker_client):
    docker_client.api.remove_container(sandbox.container_id, force=True)
    with pytest.raises(SandboxLost, match="no longer exists|not running"):
        sandbox.execute("true")
    assert not sandbox.is_alive()


def test_no_daemon_raises_daemon_unavailable(tmp_path):
    sock = f"unix://{tmp_path}/no-daemon.sock"
    with pytest.raises(DaemonUnavailable, match="cannot reach the Docker daemon at unix://.*no-daemon.sock"):
        DockerSandbox(docker_host=sock)


def test_secure_defaults(sandbox, docker_client):
    host = docker_client.api.inspect_container(sandbox.container_id)["HostConfig"]
    assert host["Privileged"] is False
    assert host["NetworkMode"] == "none"
    assert host["Memory"] == 2**30 and host["PidsLimit"] == 512 and host["NanoCpus"] == 10**9
    nets = sandbox.execute("ls /sys/class/net")["output"].split()
    assert nets == ["lo"]


def test_memory_hog_contained_and_reported(docker_client):
    with DockerSandbox(client=docker_client, memory="128m") as sb:
        r = sb.execute("python3 -c 'b = bytearray(1024 * 2**20); print(len(b))'", timeout=60)
        assert r["returncode"] == 137, r
        assert "exceeding the memory limit (128m)" in r["output"]
        assert sb.execute("echo still here")["output"] == "still here\n"


def test_fork_bomb_contained(docker_client):
    with DockerSandbox(client=docker_client, pids_limit=64) as sb:
        r = sb.execute("bomb() { bomb | bomb; }; bomb", timeout=5)
        assert r.get("timed_out") is True, r["output"][-500:]
        assert "limit of 64 processes" in r["output"]
        # the bomb's whole process group was killed: the sandbox is usable again (what runs is
        # the init, this command's wrapper with its keeper and reserve, and the command)
        assert int(sb.execute("ps -e --no-headers | wc -l")["output"]) < 10 + RESERVED_PIDS
        assert sb.execute("echo ok")["output"] == "ok\n"


def test_bad_input_raises_usage_errors(sandbox):
    with pytest.raises(InvalidAction, match="must be a str"):
        sandbox.execute(["ls"])  # type: ignore[arg-type]
    with pytest.raises(InvalidAction, match="timeout must be > 0"):
        sandbox.execute("true", timeout=0)
    with pytest.raises(InvalidAction, match="absolute"):
        sandbox.execute("true", cwd="relative")
    with pytest.raises(ConfigError, match="cwd must be an absolute path"):
        DockerSandbox(cwd="relative/dir")
    with pytest.raises(UsageError, match="not found"):
        DockerSandbox(image="belayer-no-such-image:0")
    with pytest.raises(ValueError):
        SandboxConfig(memory="1g", pids_limit=0)


def test_background_server_without_redirect_keeps_serving(sandbox):
    """A server started with a bare `&` writes its log to the command's output file, not to a
    pipe we stop reading: it must not die of EPIPE at its first log line."""
    r = sandbox.execute("cd /tmp && python3 -m http.server 8000 --bind 127.0.0.1 & echo started")
    assert r == {"output": "started\n", "returncode": 0}
    fetch = ("python3 -c \"import urllib.request,time\n"
             "for i in range(50):\n"
             "    try: print(urllib.request.urlopen('http://127.0.0.1:8000/').status); break\n"
             "    except OSError: time.sleep(0.1)\"")
    for _ in range(3):  # each request makes the server write a log line
        assert sandbox.execute(fetch)["output"] == "200\n"
    assert "http.server" in sandbox.execute("ps -eo args")["output"]


def test_the_init_is_one_process_that_reaps_orphans_and_stops_on_sigterm(docker_client):
    """PID 1 is bash alone (CRIU dumps every process inside the freeze): no ``sleep`` child,
    orphans of commands reaped, SIGTERM (``docker stop``) ends it with 0 at once."""
    sb = DockerSandbox(client=docker_client)
    try:
        procs = sb.execute("ps -eo pid=,ppid=,stat=,comm= | awk '$4 != \"ps\" && $4 != \"awk\"'")["output"]
        inits = [line.split() for line in procs.splitlines() if line.split()[1] == "0" and line.split()[0] == "1"]
        assert inits and inits[0][3] == "bash", procs
        assert not [line for line in procs.splitlines() if line.split()[1] == "1"], f"the init has children:\n{procs}"
        sb.execute("for i in 1 2 3; do (sleep 0.05 &); done")  # three orphans, reparented to PID 1
        wait_until(lambda: "sleep" not in sb.execute("ps -eo comm=")["output"], 30, "the orphans ended")
        zombies = sb.execute("ps -eo stat= | grep -c '^Z' || true")["output"].strip()
        assert zombies == "0", f"{zombies} unreaped orphans"
        container = docker_client.containers.get(sb.container_id)
        container.stop(timeout=30)
        container.reload()
        assert container.attrs["State"]["ExitCode"] == 0
    finally:
        sb.close()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_line_written_into_the_inits_fifo_grows_nothing(docker_client):
    """The init reads its FIFO a byte at a time: a sandbox process (root in it, like an agent's
    commands) that writes one endless line there cannot make PID 1 the sandbox's memory hog."""
    sb = DockerSandbox(client=docker_client)
    try:
        pid = docker_client.api.inspect_container(sb.container_id)["State"]["Pid"]
        # measured from the moment the init blocks in its read of fd 3 (its FIFO): bash still
        # starting up on a loaded machine would count its own start as growth
        wait_until(lambda: Path(f"/proc/{pid}/syscall").read_text().split()[:2] == ["0", "0x3"], 60,
                   "the init to block reading its FIFO")
        before = _rss_kib(pid)
        r = sb.execute("head -c 1048576 /dev/zero | tr '\\0' a > /run/belayer/.init && echo written", timeout=120)
        assert r["output"].strip() == "written", r
        grown = _rss_kib(pid) - before
        assert grown < 256, f"the init grew by {grown} KiB reading a 1 MiB line"
        assert sb.execute("echo alive")["output"] == "alive\n"
    finally:
        sb.close()
