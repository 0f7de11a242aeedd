"""The one /proc reader and owner-liveness rule, against real processes."""

from __future__ import annotations

import os
import subprocess
import sys

from belayer_core.procfs import OwnerId, owner_alive, process_start_time, read_stat, session_members


def test_read_stat_of_a_real_child_with_an_awkward_name():
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.stdin.read()"],
                             stdin=subprocess.PIPE, start_new_session=True)
    try:
        stat = read_stat(child.pid)
        assert stat is not None and stat.running and stat.ppid == os.getpid()
        assert stat.session == child.pid and child.pid in session_members(child.pid)
        assert stat.start_time == process_start_time(child.pid) >= process_start_time(os.getpid())
    finally:
        child.stdin.close()
        child.wait()
    assert read_stat(child.pid) is None and process_start_time(child.pid) is None


def test_owner_is_its_pid_and_start_time():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    owner = OwnerId(child.pid, process_start_time(child.pid))
    label = owner.to_label()
    assert OwnerId.from_label(label) == owner and owner.alive() and owner_alive(label)
    # the same pid with another start time is another process (pid reuse): not the owner
    assert not OwnerId(child.pid, owner.start_time + 1).alive()
    child.stdin.close()
    child.wait()
    assert not owner.alive() and not owner_alive(label)
    assert OwnerId.current().alive() and OwnerId.current().pid == os.getpid()


def test_text_that_names_no_owner_counts_as_dead():
    for label in ("", "123", "abc-1", "1-", "-1", "1-2-3"):
        assert OwnerId.from_label(label) is None and not owner_alive(label), label


def test_current_owner_of_a_forked_child_is_the_child():
    parent = OwnerId.current()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own pid and start time, not the parent's remembered one
        os.close(read_end)
        os.write(write_end, OwnerId.current().to_label().encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        label = r.read().decode()
    os.waitpid(pid, 0)
    child = OwnerId.from_label(label)
    assert child is not None and child.pid == pid != parent.pid
    assert OwnerId.current() == parent
