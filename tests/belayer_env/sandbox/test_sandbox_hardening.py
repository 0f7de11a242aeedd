"""Issue 13, sandbox level, on real containers: output of any size, long commands, the disk cap,
capabilities, and one validation for every way of configuring a sandbox."""

from __future__ import annotations

import os

import pytest

from belayer_core.errors import CheckpointFailed, InvalidAction, UsageError
from belayer_env import DockerSandbox, SandboxConfig
from belayer_env.sandbox.config import DEFAULT_CAPABILITIES, DOCKER_DEFAULT_CAPABILITIES
from belayer_env.sandbox.container import MAX_COMMAND_BYTES
from tests.conftest import wait_until

SEQ_BYTES = sum(len(str(i)) + 1 for i in range(1, 20_000_001))  # `seq 1 20000000` prints this many bytes


def _layer_dir(client, container_id: str) -> str:
    upper = client.api.inspect_container(container_id)["GraphDriver"]["Data"]["UpperDir"]
    return os.path.dirname(upper)


def _mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def _cap_mask(names) -> int:
    bits = {"CHOWN": 0, "DAC_OVERRIDE": 1, "DAC_READ_SEARCH": 2, "FOWNER": 3, "FSETID": 4, "KILL": 5,
            "SETGID": 6, "SETUID": 7, "SETPCAP": 8, "NET_BIND_SERVICE": 10, "NET_RAW": 13,
            "SYS_CHROOT": 18, "MKNOD": 27, "AUDIT_WRITE": 29, "SETFCAP": 31}
    return sum(1 << bits[n] for n in names)


# ---------------------------------------------------------------------------------- output


def test_huge_output_keeps_exit_code_head_tail_and_marker(sandbox):
    r = sandbox.execute("seq 1 20000000; echo END-MARKER", timeout=300)
    out = r["output"]
    assert r["returncode"] == 0, out[-500:]
    assert out.startswith("1\n2\n3\n") and out.endswith("19999999\n20000000\nEND-MARKER\n")
    total = SEQ_BYTES + len("END-MARKER\n")
    kept = sandbox.config.max_output_bytes
    assert f"output truncated: {total - kept} of {total} bytes omitted" in out
    # what the keeper staged is gone; the staging tmpfs is (nearly) empty again
    used = int(sandbox.execute("du -sk /run/belayer | cut -f1")["output"])
    assert used < 1024, f"{used} KiB left in /run/belayer"


def test_output_of_a_background_job_stays_bounded(sandbox):
    """A job left in the background keeps writing to its keeper's FIFO after its command was
    collected: 200 MB of it must neither fill the sandbox's tmpfs nor block the job."""
    r = sandbox.execute("(while [ ! -e /tmp/go ]; do sleep 0.05; done; for i in $(seq 200); do "
                        "head -c 1000000 /dev/zero; done; touch /tmp/bg.done; sleep 600) & echo started")
    assert r == {"output": "started\n", "returncode": 0}
    assert sandbox.execute("touch /tmp/go")["returncode"] == 0  # it writes only once collected
    wait_until(lambda: sandbox.execute("test -e /tmp/bg.done")["returncode"] == 0, 120,
               "the background job to write 200 MB")
    used = int(sandbox.execute("du -sk /run/belayer | cut -f1")["output"])
    assert used < 4 * 1024, f"{used} KiB staged for a collected background job"
    assert sandbox.execute("echo next")["output"] == "next\n"


WRITER = """python3 -c 'import sys, time
b = b"z" * 100000
for i in range(3000):
    sys.stdout.buffer.write(b)
    sys.stdout.flush()
open("/tmp/bg.done", "w").close()
time.sleep(600)' & echo $! > /tmp/bg.pid; sleep 0.5; echo started"""


def test_background_writer_survives_collection_mid_chunk(sandbox):
    """A job writing before, during and after its command is collected (the keeper is in the
    middle of a chunk then): it must never see EPIPE (300 MB, then alive), and stay bounded."""
    r = sandbox.execute(WRITER)
    # its tail is whatever the job wrote last (it never stops while collected): no "started" check
    assert r["returncode"] == 0 and r["output"].startswith("zzz") and "output truncated" in r["output"]
    wait_until(lambda: sandbox.execute("test -e /tmp/bg.done")["returncode"] == 0, 180,
               "the background writer to finish 300 MB (it died of EPIPE if this never happens)")
    assert sandbox.execute("kill -0 $(cat /tmp/bg.pid) && echo alive")["output"] == "alive\n"
    used = int(sandbox.execute("du -sk /run/belayer | cut -f1")["output"])
    assert used < 4 * 1024, f"{used} KiB staged for a collected background job"


def test_keeper_survives_its_chunks_truncated_at_any_moment(sandbox):
    """Collecting a command truncates its keeper's chunk files once; landing between the keeper's
    ``head`` and its full-chunk check used to end the keeper, and the job died of EPIPE (one CI
    run in many). Truncating them without pause while 300 MB pass makes that moment certain."""
    r = sandbox.execute(WRITER)
    assert r["returncode"] == 0 and "output truncated" in r["output"]
    hammer = ("p=$(cat /tmp/bg.pid); while [ ! -e /tmp/bg.done ] && kill -0 $p 2>/dev/null; do "
              "for f in /run/belayer/c.*/c.[01d]; do : > \"$f\"; done; done")
    assert sandbox.execute(f"({hammer}) >/dev/null 2>&1 &")["returncode"] == 0
    probe = "if [ -e /tmp/bg.done ]; then echo done; elif ! kill -0 $(cat /tmp/bg.pid) 2>/dev/null; then echo died; fi"
    state = wait_until(lambda: sandbox.execute(probe)["output"].strip(), 180,
                       "the background writer to finish or die")
    assert state == "done", "the background writer died (EPIPE: its keeper ended under a truncation)"
    assert sandbox.execute("kill -0 $(cat /tmp/bg.pid) && echo alive")["output"] == "alive\n"


# ---------------------------------------------------------------------------------- long commands


@pytest.mark.parametrize("size", [131_072, MAX_COMMAND_BYTES])
def test_long_commands_run(sandbox, size):
    head, tail = "cat > /tmp/body <<'EOF'\n", "\nEOF\nwc -c < /tmp/body"
    body = "x" * (size - len(head) - len(tail))
    command = head + body + tail
    assert len(command.encode()) == size  # 131,072: the kernel's per-argument limit, were it in argv
    r = sandbox.execute(command)
    assert r == {"output": f"{len(body) + 1}\n", "returncode": 0}


def test_command_over_the_limit_is_invalid_action(sandbox):
    with pytest.raises(InvalidAction, match=f"limit is {MAX_COMMAND_BYTES} bytes"):
        sandbox.execute("echo " + "a" * 5_000_000)
    with pytest.raises(InvalidAction, match="not valid text"):
        sandbox.execute("echo \udcff")
    assert sandbox.execute("echo fine")["output"] == "fine\n"


def test_missing_cwd_is_the_commands_failure_without_runtime_text(sandbox):
    r = sandbox.execute("pwd", cwd="/no/such/dir")
    assert r["returncode"] == 1
    assert "/no/such/dir: No such file or directory" in r["output"]
    for word in ("OCI", "runtime", "exec failed", "containerd"):
        assert word not in r["output"]


def test_env_long_and_too_long_actions(make_env):
    env = make_env(checkpoint_policy="never")
    env.reset()
    obs, *_ = env.step(f"cat > /tmp/b <<'EOF'\n{'y' * 200_000}\nEOF\nwc -c < /tmp/b")
    assert "<returncode>0</returncode>" in obs and "200001" in obs
    with pytest.raises(UsageError, match="limit is 1048576 bytes"):
        env.step("echo " + "a" * 5_000_000)
    obs, *_ = env.step("echo still")
    assert "still" in obs and len(env.trajectory.steps) == 2


def test_a_cut_exec_stream_is_never_a_result(docker_client):
    """The transport cut as the command is sent, or while it runs shortly before it exits
    (``execute`` used to return Docker's 126 with no output then, or a truncated result):
    ``SandboxLost``, never a result."""
    import threading

    from belayer_core.errors import SandboxLost
    from belayer_env.faults.inject import TransportBreaker
    from belayer_env.sandbox.docker_api import connect

    client = connect()  # its own client: the breaker wraps this one's exec_start
    breaker = TransportBreaker(client)
    with DockerSandbox(client=client) as sb:
        breaker.cut_next()
        with pytest.raises(SandboxLost):
            sb.execute("echo ran > /tmp/ran")
        upper = docker_client.api.inspect_container(sb.container_id)["GraphDriver"]["Data"]["UpperDir"]
        started = os.path.join(upper, "tmp", "started")
        outcome: dict = {}

        def run() -> None:
            try:
                outcome["result"] = sb.execute("touch /tmp/started; sleep 1; echo out")
            except BaseException as e:  # noqa: BLE001 - inspected below
                outcome["error"] = e

        t = threading.Thread(target=run)
        t.start()
        wait_until(lambda: os.path.exists(started), 30, "the command to start")
        breaker.break_all()
        t.join(60)
        assert "result" not in outcome, f"a cut stream came back as a result: {outcome}"
        assert isinstance(outcome["error"], SandboxLost), outcome
        assert sb.execute("echo fine")["output"] == "fine\n"  # the sandbox itself is alive


# ---------------------------------------------------------------------------------- disk


def test_disk_cap_is_enospc_inside_and_leaves_nothing(docker_client):
    sb = DockerSandbox(client=docker_client, disk="256m")
    layer = _layer_dir(docker_client, sb.container_id)
    try:
        assert _mounted(layer)
        st = os.statvfs(layer)
        assert st.f_blocks * st.f_frsize <= 256 * 2**20  # the host gives this layer 256 MiB at most
        r = sb.execute("dd if=/dev/zero of=/big bs=1M count=20000", timeout=300)
        assert r["returncode"] == 1 and "No space left on device" in r["output"], r["output"][-500:]
        size = int(sb.execute("stat -c %s /big")["output"])
        assert size <= 256 * 2**20
        assert sb.execute("rm /big && echo 1 > /ok && cat /ok")["output"] == "1\n"  # usable again
    finally:
        sb.close()
    assert not _mounted(layer) and not os.path.exists(layer)  # unmounted and removed with the container


def test_default_disk_cap_and_none(docker_client):
    with DockerSandbox(client=docker_client) as sb:
        layer = _layer_dir(docker_client, sb.container_id)
        st = os.statvfs(layer)
        assert _mounted(layer) and st.f_blocks * st.f_frsize <= SandboxConfig().disk_bytes
    with DockerSandbox(client=docker_client, disk=None) as sb:
        assert not _mounted(_layer_dir(docker_client, sb.container_id))


def test_capped_layer_checkpoint_restore_and_capture_limit(make_sandbox, tmp_path, docker_client):
    from belayer_env.capture.checkpoint import full_checkpoint
    from belayer_env.restore.restore import full_restore
    from belayer_env.store.store import CheckpointStore

    store = CheckpointStore(tmp_path / "store", max_layer_bytes=64 * 2**20)
    sb = make_sandbox(disk="512m")
    sb.execute("echo kept > /kept.txt; setsid bash -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/n; "
               "sleep 0.05; done' >/dev/null 2>&1 </dev/null &")
    wait_until(lambda: sb.execute("cat /tmp/n")["returncode"] == 0, 30, "the counter to start")
    first = full_checkpoint(sb, store, 1)

    assert sb.execute("head -c 100000000 /dev/urandom > /blob")["returncode"] == 0
    with pytest.raises(CheckpointFailed, match="checkpoint limit of 67108864 bytes"):
        full_checkpoint(sb, store, 2)
    assert [c.id for c in store.list(sb.name)] == [first.id]  # the older one is intact
    assert not docker_client.api.inspect_container(sb.container_id)["State"]["Paused"]
    assert os.listdir(store.scratch_root) == [] or all(sb.name not in d for d in os.listdir(store.scratch_root))

    restored = full_restore(first, client=docker_client)
    try:
        assert restored.execute("cat /kept.txt; test -e /blob || echo no-blob")["output"] == "kept\nno-blob\n"
        n0 = int(restored.execute("cat /tmp/n")["output"])
        wait_until(lambda: int(restored.execute("cat /tmp/n")["output"]) > n0, 30, "the restored counter to go on")
        layer = _layer_dir(docker_client, restored.container_id)
        st = os.statvfs(layer)
        assert _mounted(layer) and st.f_blocks * st.f_frsize <= 512 * 2**20  # still capped after restore
    finally:
        restored.close()


def test_capture_limit_without_a_disk_cap(make_sandbox, tmp_path):
    """No capped file system to measure: the tar itself is bounded (RLIMIT_FSIZE)."""
    from belayer_env.capture.checkpoint import full_checkpoint
    from belayer_env.store.store import CheckpointStore

    store = CheckpointStore(tmp_path / "store", max_layer_bytes=32 * 2**20)
    sb = make_sandbox(disk=None)
    assert sb.execute("head -c 50000000 /dev/urandom > /blob")["returncode"] == 0
    with pytest.raises(CheckpointFailed, match="checkpoint limit of 33554432 bytes"):
        full_checkpoint(sb, store, 1)
    assert store.list() == []
    assert sb.execute("echo alive")["output"] == "alive\n"


# ---------------------------------------------------------------------------------- capabilities


def test_capabilities_cut_by_default_and_restorable(docker_client):
    with DockerSandbox(client=docker_client) as sb:
        eff = int(sb.execute("grep CapEff /proc/self/status | cut -f2")["output"], 16)
        assert eff == _cap_mask(DEFAULT_CAPABILITIES)
        r = sb.execute("mknod /tmp/null c 1 3")
        assert r["returncode"] != 0 and "Operation not permitted" in r["output"]
        # what SWE work needs still works: owners, modes, files of other users, user switching
        r = sb.execute("useradd -m u1 && echo hi > /tmp/f && chown u1:u1 /tmp/f && chmod 600 /tmp/f && "
                       "cat /tmp/f && su u1 -s /bin/sh -c 'id -un' && kill -0 1 && echo ok")
        assert r == {"output": "hi\nu1\nok\n", "returncode": 0}, r
    with DockerSandbox(client=docker_client, capabilities=DOCKER_DEFAULT_CAPABILITIES) as sb:
        eff = int(sb.execute("grep CapEff /proc/self/status | cut -f2")["output"], 16)
        assert eff == _cap_mask(DOCKER_DEFAULT_CAPABILITIES)
        assert sb.execute("mknod /tmp/null c 1 3 && echo made")["output"] == "made\n"


# ---------------------------------------------------------------------------------- validation

BAD = [({"cpus": 0}, "cpus"), ({"foo": 1}, "foo"), ({"network": "yes"}, "network"), ({"pids_limit": 1}, "pids_limit"),
       ({"max_output_bytes": 0}, "max_output_bytes"), ({"memory": "lots"}, "memory"), ({"timeout": -1}, "timeout"),
       ({"disk": "1k"}, "disk"), ({"capabilities": ["SYS_WIZARD"]}, "capabilities")]


@pytest.mark.parametrize("bad,field", BAD, ids=[f for _, f in BAD])
def test_every_way_of_configuring_validates_the_same(bad, field, docker_client):
    import gymnasium as gym

    import belayer_env  # noqa: F401 - registers the env
    from belayer_env.env.recoverable import EnvConfig, RecoverableSandboxEnv

    ways = {
        "DockerSandbox": lambda: DockerSandbox(client=docker_client, **bad),
        "SandboxConfig": lambda: SandboxConfig(**bad),
        "merged": lambda: SandboxConfig.merged(SandboxConfig(), bad),
        "EnvConfig": lambda: EnvConfig(sandbox=bad),
        "env kwargs": lambda: RecoverableSandboxEnv(client=docker_client, **bad),
        "gym.make": lambda: gym.make("belayer/Sandbox-v0", **bad),
    }
    for way, make in ways.items():
        with pytest.raises(UsageError, match=field) as info:
            make()
        assert "\n" not in str(info.value), f"{way}: not one line: {info.value}"


def test_reset_options_and_env_fields_validated(make_env):
    import gymnasium as gym

    import belayer_env  # noqa: F401

    env = make_env(checkpoint_policy="never", max_steps=1)  # an EnvConfig field goes to the env
    assert env.config.max_steps == 1
    for options, field in (({"task": 5}, "task"), ({"tsak": "x"}, "tsak"), ({"setup": 3}, "setup"), ("x", "dict")):
        with pytest.raises(UsageError, match=field):
            env.reset(options=options)
    obs, _ = env.reset(options={"task": "t", "setup": "echo s > /s"})
    assert obs == "t" and "s" in env.step("cat /s")[0]
    with pytest.raises(UsageError, match="max_steps"):
        gym.make("belayer/Sandbox-v0", max_steps=0)
