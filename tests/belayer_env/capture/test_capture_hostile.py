"""What an agent's ordinary (or careless) actions leave in a sandbox must not stop its
checkpoints (issue 36): a deleted temp file held open, a traced and stopped process, a path
past PATH_MAX. Where a checkpoint still cannot be taken, the env says why in one line at the
step that found out, the policy counts it, the trajectory records it, and the older ready
checkpoint stays. Real containers, real CRIU."""

from __future__ import annotations

import pytest

from belayer_core.errors import CheckpointFailed
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.env.policy import AdaptivePolicy
from belayer_env.forks.fork import fork
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox.fence import fence
from belayer_env.sandbox.treehash import tree_hash
from tests.conftest import wait_until

# a background process holding a deleted temp file of SIZE bytes (whole MiB of data); the
# command returns once it is in place, its pid in /tmp/holder.pid
HOLDER = ("python3 -c 'import os,sys,tempfile,time\n"
          "f=tempfile.TemporaryFile(); n=int(sys.argv[1])\n"
          "[f.write(b\"x\"*2**20) for _ in range(n>>20)]; f.flush()\n"
          "pid=os.fork()\n"
          "if pid: open(\"/tmp/holder.pid\",\"w\").write(str(pid)); os._exit(0)\n"
          "os.setsid(); time.sleep(1e6)' {size} >/dev/null 2>&1 </dev/null")
HELD_SIZE = "stat -L -c %s /proc/$(cat /tmp/holder.pid)/fd/3"
# a child that asks to be traced by its parent and stops (what gdb or strace leave behind);
# the command returns once it is stopped, its pid in /tmp/traced.pid
TRACED = ("python3 -c 'import ctypes,os,signal,time\n"
          "r,w=os.pipe()\n"
          "if os.fork(): os.close(w); os.read(r,1); os._exit(0)\n"
          "os.setsid(); pid=os.fork()\n"
          "if pid==0: ctypes.CDLL(None).ptrace(0,0,0,0); os.kill(os.getpid(),signal.SIGSTOP); time.sleep(1e6)\n"
          "os.waitpid(pid,os.WUNTRACED); open(\"/tmp/traced.pid\",\"w\").write(str(pid))\n"
          "os.write(w,b\"x\"); time.sleep(1e6)' >/dev/null 2>&1 </dev/null")
TRACED_STOPPED = "grep -q '^State:.*t (tracing stop)' /proc/$(cat /tmp/traced.pid)/status"


# a 5,105-character directory path (past PATH_MAX), with a file, a hard link to it (one deep,
# one short), a symlink, a FIFO and a sparse file at the bottom
DEEP = ("cd /tmp && for i in $(seq 50); do mkdir d$(printf '%0100d' 0) && cd d*; done && "
        "echo deep > f && chmod 640 f && chown 123:456 f && ln f g && ln f /tmp/short-link && ln -s f s && "
        "mkfifo p && truncate -s 10M sparse && echo x >> sparse && pwd | wc -c")
IN_DEEP = "cd /tmp && for i in $(seq 50); do cd d*; done && "


def _restored_hash(ck, docker_client) -> str:
    restored = full_restore(ck, client=docker_client)
    try:
        return tree_hash(restored, "/tmp")
    finally:
        fence(docker_client, restored.name, background=False)


@pytest.mark.parametrize("capture", ["incremental", "paused"])
def test_a_path_past_path_max_does_not_stop_checkpoints(make_sandbox, ck_store, docker_client, capture):
    sb = make_sandbox()
    full_checkpoint(sb, ck_store, 1, capture=capture)  # the next capture is a delta against this one
    assert sb.execute(DEEP)["output"].strip() == "5105"  # characters, with the newline
    hashes = {2: tree_hash(sb, "/tmp")}
    ck2 = full_checkpoint(sb, ck_store, 2, capture=capture)
    # a change deep down, another one left as it was, one removed
    assert sb.execute(IN_DEEP + "echo more >> f && rm s && mkdir e && echo new > e/h")["returncode"] == 0
    hashes[3] = tree_hash(sb, "/tmp")
    ck3 = full_checkpoint(sb, ck_store, 3, capture=capture)
    assert _restored_hash(ck2, docker_client) == hashes[2]
    restored = full_restore(ck3, client=docker_client)
    try:
        assert tree_hash(restored, "/tmp") == hashes[3]
        # a restored sandbox's next capture starts from the checkpoint it came from
        assert restored.execute(IN_DEEP + "rm g && echo again > e/h")["returncode"] == 0
        hashes[4] = tree_hash(restored, "/tmp")
        ck4 = full_checkpoint(restored, ck_store, 4, capture=capture)
    finally:
        fence(docker_client, restored.name, background=False)
    assert _restored_hash(ck4, docker_client) == hashes[4]


def test_a_fork_with_a_path_past_path_max_checkpoints_whole(make_sandbox, ck_store, docker_client):
    """A fork's capture merges the shared layer under its own upperdir: with a long path it is
    merged in a copy (whiteouts and opaque directories honoured), never left out."""
    src = make_sandbox()
    assert src.execute("mkdir -p /w/sub && echo a > /w/a && echo b > /w/sub/b && echo k > /w/keep")["returncode"] == 0
    (child,) = fork(full_checkpoint(src, ck_store, 1), 1, client=docker_client)
    try:
        assert child.execute("rm /w/a && rm -rf /w/sub && mkdir /w/sub && echo c > /w/sub/c && " + DEEP)["returncode"] == 0
        before = {root: tree_hash(child, root) for root in ("/w", "/tmp")}
        for i, mode in enumerate(("incremental", "paused")):
            restored = full_restore(full_checkpoint(child, ck_store, 2 + i, capture=mode), client=docker_client,
                                    name=f"{child.name}-r{i}")
            try:
                assert {root: tree_hash(restored, root) for root in before} == before, mode
                assert restored.execute("ls /w /w/sub")["output"] == "/w:\nkeep\nsub\n\n/w/sub:\nc\n"
            finally:
                fence(docker_client, restored.name, background=False)
    finally:
        fence(docker_client, child.name, background=False)


def test_a_long_path_in_a_tmpfs_is_refused_not_made_unrestorable(make_sandbox, ck_store):
    """CRIU dumps a tmpfs (``/dev/shm``) with tar and restores it with GNU tar, which cannot
    make a path past PATH_MAX: refused at once, in one line, rather than a checkpoint that is
    ready and can never be restored."""
    sb = make_sandbox()
    assert sb.execute(DEEP.replace("cd /tmp", "cd /dev/shm").replace("/tmp/short-link", "/dev/shm/l"))["returncode"] == 0
    phases = []
    with pytest.raises(CheckpointFailed) as err:
        full_checkpoint(sb, ck_store, 1, phase_hook=phases.append)
    assert phases == [] and err.value.reason.startswith("the tmpfs at /dev/shm holds a path of more than")
    assert ck_store.list(sb.name) == []


def _holder(sb, size: int) -> None:
    assert sb.execute(HOLDER.format(size=size))["returncode"] == 0
    assert sb.execute(HELD_SIZE)["output"].strip() == str(size)


def test_a_deleted_temp_file_larger_than_criu_default_is_checkpointed(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    _holder(sb, 5 << 20)
    ck = full_checkpoint(sb, ck_store, 1)
    assert ck.has_runtime
    restored = full_restore(ck, client=docker_client)
    try:
        assert restored.execute(HELD_SIZE)["output"].strip() == str(5 << 20)  # same process, same file
    finally:
        fence(docker_client, restored.name, background=False)


def test_a_stopped_process_is_refused_before_any_freeze(make_sandbox, ck_store):
    """Seizing a stopped task wakes it to re-trap, which it cannot do frozen: CRIU would wait
    in ptrace_attach until the dump's timeout. Refused at once instead, in one line."""
    sb = make_sandbox()
    assert sb.execute("setsid sh -c 'kill -STOP $$; exec sleep 1000' >/dev/null 2>&1 </dev/null &")["returncode"] == 0
    wait_until(lambda: "T (stopped)" in sb.execute("grep -h '^State:' /proc/[0-9]*/status")["output"], 30,
               "the process stopped")
    phases = []
    with pytest.raises(CheckpointFailed, match="is stopped") as err:
        full_checkpoint(sb, ck_store, 1, phase_hook=phases.append)
    assert phases == [] and "CRIU cannot seize a stopped process" in err.value.reason
    assert sb.execute("echo alive")["output"] == "alive\n"


def test_a_traced_stopped_process_is_refused_before_any_freeze(make_sandbox, ck_store):
    sb = make_sandbox()
    assert sb.execute(TRACED)["returncode"] == 0
    assert sb.execute(TRACED_STOPPED)["returncode"] == 0
    phases = []
    with pytest.raises(CheckpointFailed, match="traced") as err:
        full_checkpoint(sb, ck_store, 1, phase_hook=phases.append)
    assert phases == []  # refused before the freeze: never frozen for CRIU's 10 s seize timeout
    assert "CRIU cannot checkpoint a traced process" in err.value.reason
    assert ck_store.list(sb.name) == []
    assert sb.execute("echo alive")["output"] == "alive\n"


class _EveryStep(AdaptivePolicy):
    """The adaptive policy's bookkeeping, a capture at every boundary past 0."""

    def should_checkpoint(self, step: int) -> bool:
        return step > 0


def _step_settled(env, action: str) -> dict:
    info = env.step(action)[4]
    env.settle(120)
    return info


@pytest.mark.parametrize("case", ["ghost", "traced"])
def test_env_reports_a_failed_capture_in_one_line_and_keeps_the_older_one(make_env, case):
    policy = _EveryStep()
    env = make_env(checkpoint_policy=policy, memory="96m")
    env.reset()
    _step_settled(env, "echo one > /one")
    first = env.checkpointer.ready[-1]
    assert first.step == 1
    # step 2 leaves what its capture cannot take: a deleted file past the sandbox's memory
    # (the ghost limit), or a traced process
    bad = HOLDER.format(size=128 << 20) if case == "ghost" else TRACED
    _step_settled(env, bad)
    info = env.step("echo three")[4]
    failed = info["belayer"]["checkpoint_failed"]
    assert failed["step"] == 2 and "\n" not in failed["reason"]
    if case == "ghost":
        assert failed["reason"].startswith("criu: Can't dump ghost file") and "increase limit" in failed["reason"]
    else:
        assert "is traced by process" in failed["reason"]
    assert policy.capture_failures >= 1
    event = next(e for e in env.trajectory.events if e.kind == "checkpoint_failed")
    assert event.at_step >= 2 and event.reason == failed["reason"]
    assert env.checkpointer.ready[0].id == first.id and (first.path / "manifest.json").exists()
