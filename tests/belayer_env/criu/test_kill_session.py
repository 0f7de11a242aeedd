"""``runtime.kill_session`` (how a timed-out or aborted dump ends runc and CRIU) leaves no
process of the session alive, children forked while it scans included: CRIU forks helper
children early in every dump that sleep until killed, and one scan left such a child
orphaned for good (seen after full test runs: ``criu swrk 3`` in ``sleep(1000)``, parent
init). Real processes: a session leader that keeps forking while it is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

from belayer_core.procfs import session_members
from belayer_env.criu.runtime import kill_session
from tests.conftest import wait_until

FORKER = "for i in $(seq 400); do sleep 1000 & done; wait"


def test_a_session_that_keeps_forking_is_ended_whole():
    for _ in range(3):
        leader = subprocess.Popen(["bash", "-c", FORKER], start_new_session=True)
        try:
            wait_until(lambda leader=leader: len(session_members(leader.pid, live=True)) > 20, 30, "the leader forked")
            killed = kill_session(leader.pid)
            assert leader.pid in killed
            leader.wait(30)
            wait_until(lambda leader=leader: not session_members(leader.pid, live=True), 30, "no process of the session alive")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader.pid, signal.SIGKILL)
            leader.wait(30)
