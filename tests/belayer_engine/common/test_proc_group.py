"""A worker's group members other than its leader: found by process group and title (what
SGLang names its ranks), and a member's exit seen through a pidfd although it is not this
process's child."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

from belayer_engine.common.proc_group import group_members, wait_exit

# a leader whose child renames itself (exec -a) as an SGLang rank does (setproctitle)
LEADER = "exec -a sglang::scheduler_TP1 sleep 300 & wait $!"


def test_members_are_found_by_group_and_a_members_exit_is_seen():
    leader = subprocess.Popen(["bash", "-c", LEADER], start_new_session=True)
    try:
        for _ in range(500):  # until bash has forked the child (a poll of /proc, no sleep)
            members = group_members(leader.pid)
            if "sglang::scheduler_TP1" in members.values():
                break
            os.sched_yield()
        assert list(members.values()) == ["sglang::scheduler_TP1"], members
        assert leader.pid not in members and os.getpid() not in members
        (pid,) = members

        async def watch() -> None:
            waiting = asyncio.create_task(wait_exit(pid))
            await asyncio.sleep(0)
            assert not waiting.done(), "the member still runs"
            os.kill(pid, signal.SIGKILL)
            await asyncio.wait_for(waiting, 30)

        asyncio.run(watch())
        assert leader.wait(30) == 128 + signal.SIGKILL, "the leader saw its member killed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_a_gone_pid_returns_at_once():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    asyncio.run(asyncio.wait_for(wait_exit(proc.pid), 5))
