"""``BelayerSandbox`` (wrappers/slime/sandbox.py) as slime's ``Sandbox`` protocol, over real
containers and a real kill. slime is not installed (not on the package index): the protocol
is checked against its source, slime/agent/sandbox.py (THUDM/slime at 624b824), lines
quoted per check; ``ensure_agent_user`` runs the command slime's own helper sends."""

from __future__ import annotations

import asyncio
import hashlib
import inspect

import pytest

from belayer.wrappers.slime import BelayerSandbox, SandboxRolledBack
from belayer_env.faults import kill_container
from tests.belayer_env.conftest_env import containers_of


def test_the_protocol_of_slime_agent_sandbox():
    # sandbox.py line 40 (sandbox_id: str), 42-44 (async context), 46-56 (exec), 57 (write_file), 59 (read_file)
    for name in ("__aenter__", "__aexit__", "exec", "write_file", "read_file"):
        assert inspect.iscoroutinefunction(getattr(BelayerSandbox, name)), name
    exec_params = inspect.signature(BelayerSandbox.exec).parameters
    assert list(exec_params) == ["self", "cmd", "user", "env", "timeout", "check", "idempotent"]
    assert {n: p.default for n, p in exec_params.items() if n not in ("self", "cmd")} == \
        {"user": "root", "env": None, "timeout": 120, "check": False, "idempotent": True}
    assert all(exec_params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("user", "env", "timeout"))
    for name in ("write_file", "read_file"):
        user = inspect.signature(getattr(BelayerSandbox, name)).parameters["user"]
        assert user.kind is inspect.Parameter.KEYWORD_ONLY and user.default == "root"
    assert BelayerSandbox().sandbox_id == ""


def test_exec_files_and_users_on_a_real_sandbox(docker_client, tmp_path):
    blob = bytes(range(256)) * 1500 + b"tail"  # 384 KiB + 4: two write chunks, binary
    host_file = tmp_path / "blob.bin"
    host_file.write_bytes(blob)
    text = "".join(f"line {i}: ünïcödé\n" for i in range(12_000))  # ~250 KB: several read chunks

    async def scenario() -> str:
        async with BelayerSandbox(image="belayer-base:latest", cwd="/tmp") as sb:
            assert sb.sandbox_id and await sb.exec("echo hi; echo err >&2") == (0, "hi\nerr\n", "")
            assert await sb.exec("echo $A-$B", env={"A": "x y", "B": "'q'"}) == (0, "x y-'q'\n", "")
            assert (await sb.exec("exit 3"))[0] == 3
            with pytest.raises(RuntimeError, match="exit=3"):
                await sb.exec("exit 3", check=True)
            assert (await sb.exec("sleep 30", timeout=1))[0] in (124, 137)  # the command's outcome
            # slime's ensure_agent_user (sandbox.py lines 390-399), then a command as that user
            await sb.exec("id agent >/dev/null 2>&1 || useradd -m -s /bin/bash agent && "
                          "chown -R agent:agent /home/agent /tmp && "
                          "git config --system --add safe.directory '*' && id agent",
                          user="root", check=True, timeout=60)
            assert await sb.exec("id -un; pwd", user="agent") == (0, "agent\n/tmp\n", "")
            await sb.write_file("/work/sub/blob.bin", host_file)  # a host Path, parents made
            await sb.write_file("/work/text.txt", text)
            await sb.write_file("/home/agent/mine", b"agent's", user="agent")
            sums = await sb.exec("sha256sum /work/sub/blob.bin; stat -c %U /home/agent/mine")
            assert sums[1].split()[0] == hashlib.sha256(blob).hexdigest() and sums[1].split()[2] == "agent"
            assert await sb.read_file("/work/text.txt") == text
            assert await sb.read_file("/home/agent/mine", user="agent") == "agent's"
            assert await sb.read_file("/nonexistent") == ""  # as E2BSandbox.read_file (lines 380-387)
            return sb.sandbox.name

    name = asyncio.run(scenario())
    assert not containers_of(docker_client, name), "the sandbox's container outlived the context"


def test_over_an_env_a_kill_is_a_rollback_the_caller_sees(make_env, docker_client):
    """Over a RecoverableSandboxEnv each exec is a step; after a real SIGKILL of the container
    the env restores the newest boundary and ``exec`` raises ``SandboxRolledBack`` with it:
    the sandbox holds the files of that boundary and the caller redoes what came after."""
    env = make_env(checkpoint_policy="always")

    async def scenario() -> None:
        async with BelayerSandbox(env=env, reset_options={"task": "t"}) as sb:
            await sb.write_file("/tmp/a", "1")  # steps 1-2 (truncate, then one chunk)
            await sb.exec("echo 2 >> /tmp/a")  # step 3
            await asyncio.to_thread(env.settle)
            kill_container(docker_client, env.sandbox.container_id)
            with pytest.raises(SandboxRolledBack) as rolled:
                await sb.exec("echo 3 >> /tmp/a")
            assert rolled.value.to_step == 3 and rolled.value.reason == "SandboxLost"
            assert await sb.read_file("/tmp/a") == "12\n"
            await sb.exec("echo 3 >> /tmp/a", check=True)
            assert await sb.read_file("/tmp/a") == "12\n3\n"

    asyncio.run(scenario())
    assert [e.kind for e in env.trajectory.events if e.kind == "rollback"] == ["rollback"]

