"""``ThreadSet.held``: work started during a hold runs once the last hold ends, never lost."""

from __future__ import annotations

import threading

from belayer_env.common.background import ThreadSet


def test_work_held_until_the_last_hold_ends():
    jobs = ThreadSet("test-held")
    ran: list[int] = []
    done = threading.Event()

    def job(i: int) -> None:
        ran.append(i)
        if len(ran) == 3:
            done.set()

    with jobs.held():
        with jobs.held():
            jobs.start(job, 1)
        jobs.start(job, 2)
        assert ran == [] and jobs.wait(5.0)  # nothing started yet: nothing to wait for
    jobs.start(job, 3)  # no hold: at once
    assert done.wait(10.0), f"held work did not run after the hold ended: ran {ran}"
    assert jobs.wait(10.0) and sorted(ran) == [1, 2, 3]


def test_a_failing_block_still_releases_its_work():
    jobs = ThreadSet("test-held-error")
    done = threading.Event()
    try:
        with jobs.held():
            jobs.start(done.set)
            raise RuntimeError("the fork failed")
    except RuntimeError:
        pass
    assert done.wait(10.0), "work held by a block that raised was never started"


def test_wait_never_sees_a_thread_that_has_not_started():
    """``env.close`` waits on clean-up that other threads keep starting: a thread listed
    before its ``start()`` made ``wait`` raise "cannot join thread before it is started"."""
    jobs = ThreadSet("test-start-race")
    stop = threading.Event()
    errors: list[BaseException] = []

    def starter() -> None:
        while not stop.is_set():
            jobs.start(lambda: None)

    def waiter() -> None:
        try:
            while not stop.is_set():
                jobs.wait(0.01)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=starter), threading.Thread(target=starter), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    threading.Event().wait(2.0)  # let starts and waits race for a while; the bound, not a sync
    stop.set()
    for t in threads:
        t.join(10.0)
    assert not errors, f"wait joined a thread that had not started: {errors[0]!r}"
    assert jobs.wait(10.0), "started work never finished"
