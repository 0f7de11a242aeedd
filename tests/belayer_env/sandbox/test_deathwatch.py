"""``DeathWatch`` over real containers: a kill is reported at once, once, and only while armed."""

from __future__ import annotations

import queue

import pytest

from belayer_env.faults.inject import kill_container
from belayer_env.sandbox.deathwatch import DeathWatch

REPORT_WAIT_S = 30


@pytest.fixture
def watch(docker_client):
    reports: queue.Queue[int] = queue.Queue()
    w = DeathWatch(docker_client, reports.put)
    if not w.available:
        pytest.skip("no pidfd_open on this host")
    w.reports = reports
    yield w
    w.disarm()


def test_a_kill_is_reported_with_the_arming_generation(watch, sandbox, docker_client):
    generation = watch.arm(sandbox.container_id)
    assert sandbox.execute("true")["returncode"] == 0  # alive and armed: nothing to report
    assert watch.reports.empty()
    kill_container(docker_client, sandbox.container_id)
    assert watch.reports.get(timeout=REPORT_WAIT_S) == generation
    assert watch.available


def test_a_disarmed_watch_reports_nothing(watch, sandbox, docker_client):
    watch.arm(sandbox.container_id)
    watch.disarm()
    kill_container(docker_client, sandbox.container_id)
    # armed again on a dead container: reported at once, so nothing from the first arming can
    # still be on its way after this one arrives
    generation = watch.arm(sandbox.container_id)
    assert watch.reports.get(timeout=REPORT_WAIT_S) == generation
    assert watch.reports.empty()


def test_rearming_moves_the_watch(watch, docker_client):
    from belayer_env import DockerSandbox

    first, second = DockerSandbox(client=docker_client), DockerSandbox(client=docker_client)
    try:
        watch.arm(first.container_id)
        generation = watch.arm(second.container_id)
        kill_container(docker_client, first.container_id)
        kill_container(docker_client, second.container_id)
        assert watch.reports.get(timeout=REPORT_WAIT_S) == generation
        assert watch.reports.empty()
    finally:
        first.close()
        second.close()
