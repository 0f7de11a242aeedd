"""Env hardening (issue 13): one thread at a time, wedged containers thawed by the fence,
corrupt checkpoints refused before the live sandbox is touched, an action that ends its
own sandbox, no staging left behind. Real containers, real CRIU, real threads."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import docker
import pytest
import requests

from belayer_core.errors import RestoreFailed, UsageError
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.faults.inject import kill_container
from belayer_env.restore.prestaging import PREFIX, STAGED, docker_tmp, staged_copies
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox import freezer
from belayer_env.sandbox.docker_api import docker_url
from belayer_env.sandbox.fence import sandbox_containers
from belayer_env.store.store import owner_tag
from tests.belayer_env.conftest_checkpoint import log_state, start_counter
from tests.belayer_env.conftest_env import assert_no_infra_text
from tests.conftest import wait_until


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_second_thread_gets_a_usage_error_at_once(make_env, docker_client):
    env = make_env(checkpoint_policy="always")
    env.reset()
    release = "/tmp/release"
    t, out = _in_thread(env.step, f"touch /tmp/started; while [ ! -e {release} ]; do sleep 0.05; done; echo done")
    wait_until(lambda: env.sandbox.execute("test -e /tmp/started")["returncode"] == 0, 30, "the first step to run")
    for call in (lambda: env.step("true"), lambda: env.reset(), env.close, env.settle):
        with pytest.raises(UsageError, match="one thread at a time"):
            call()
    env.sandbox.execute(f"touch {release}")
    t.join(60)
    assert not t.is_alive(), "the first thread's step never returned"
    obs, _r, _te, _tr, info = out["result"]
    assert info["returncode"] == 0 and obs.endswith("<output>\ndone\n</output>")
    env.settle()
    assert env.step("echo next")[4]["belayer"]["step"] == 2, "the env is not usable after the refused calls"
    assert [c["State"] for c in sandbox_containers(docker_client, env.name)] == ["running"]


def _unpause(client, cid: str, timeout: float) -> bool:
    """Docker's unpause, bounded; False when Docker does not answer in time."""
    try:
        client.api._raise_for_status(client.api._post(client.api._url("/containers/{0}/unpause", cid),
                                                      timeout=timeout))
    except requests.exceptions.RequestException:
        return False
    except docker.errors.APIError:
        pass
    return True


def _wedge(client, cid: str, attempts: int = 40) -> threading.Thread | None:
    """Race an exec against a pause until the exec's ``runc init`` is frozen half-way in
    and Docker stops answering about the container; return the stuck exec's thread."""
    rng = random.Random(7)
    slow = docker.APIClient(base_url=docker_url(), timeout=300)
    for _ in range(attempts):
        t, _out = _in_thread(lambda: slow.exec_start(slow.exec_create(cid, ["true"])["Id"]))
        threading.Event().wait(rng.uniform(0, 0.09))  # where the pause lands in the exec: the race
        try:
            client.api._post(client.api._url("/containers/{0}/pause", cid), timeout=5)
        except requests.exceptions.RequestException:
            pass
        if freezer.is_frozen(cid) and not _unpause(client, cid, timeout=5):
            return t  # frozen, and Docker cannot unpause it: wedged
        t.join(30)
    return None


def test_fence_thaws_a_container_wedged_by_an_exec_racing_a_pause(make_env, docker_client):
    env = make_env(checkpoint_policy="never")
    env.reset()
    cid, name = env.sandbox.container_id, env.name
    stuck = _wedge(docker_client, cid)
    if stuck is None:
        pytest.skip("could not reproduce the exec/pause race in 40 attempts on this host")
    assert freezer.is_frozen(cid)
    t, out = _in_thread(env.close)
    t.join(120)
    assert not t.is_alive(), "close() wedged on a frozen container"
    assert "error" not in out, out
    assert not sandbox_containers(docker_client, name), "a container of the closed env is left"
    stuck.join(60)
    assert not stuck.is_alive(), "the exec frozen half-way in never ended"


def test_fence_thaws_a_cgroup_frozen_container_docker_thinks_running(make_env, docker_client):
    env = make_env(checkpoint_policy="never")
    env.reset()
    cid, name = env.sandbox.container_id, env.name
    control = freezer.control_file(cid)
    assert control is not None, "no freezer cgroup found for the container"
    control.write_text("FROZEN" if control.name == "freezer.state" else "1")
    wait_until(lambda: freezer.is_frozen(cid), 10, "the cgroup to freeze")
    assert docker_client.api.inspect_container(cid)["State"]["Status"] == "running"  # Docker's view is stale
    obs, _r, _te, _tr, info = env.step("echo after")  # the exec cannot start: infra, recovered
    assert info["belayer"]["rollback"]["to_step"] == 0 and env.sandbox.container_id != cid
    assert_no_infra_text(obs)
    assert not docker_client.api.containers(all=True, filters={"id": cid}), "the frozen container survived"
    assert env.step("echo ok")[0].endswith("<output>\nok\n</output>")
    env.close()
    assert not sandbox_containers(docker_client, name)


def _flip_byte(path: Path, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _largest_image(ck) -> Path:
    return max((ck.path / "runtime").glob("pages-*.img"), key=lambda p: p.stat().st_size)


CORRUPTIONS = {
    "layer byte": (lambda ck: _flip_byte(ck.path / "layer.tar", 700), "layer.tar"),
    "CRIU image byte": (lambda ck: _flip_byte(_largest_image(ck)), "pages-"),
    "deleted CRIU image": (lambda ck: (ck.path / "runtime" / "inventory.img").unlink(), "inventory.img"),
    "deleted layer": (lambda ck: (ck.path / "layer.tar").unlink(), "layer.tar"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_checkpoint_is_refused_before_the_live_sandbox_is_touched(corruption, make_sandbox, ck_store,
                                                                          docker_client):
    sb = make_sandbox()
    start_counter(sb)
    sb.execute("echo kept > /root/state")
    ck = full_checkpoint(sb, ck_store)
    damage, names = CORRUPTIONS[corruption]
    damage(ck)
    counted = log_state(sb)[0]
    with pytest.raises(RestoreFailed) as e:
        full_restore(ck, client=docker_client)
    assert e.value.checkpoint == ck.id and names in str(e.value), str(e.value)
    assert [c["Id"] for c in sandbox_containers(docker_client, sb.name, by_name=True)] == [sb.container_id]
    assert docker_client.api.inspect_container(sb.container_id)["Name"] == f"/{sb.name}", "live sandbox renamed"
    wait_until(lambda: log_state(sb)[0] > counted + 5, 30, "the live sandbox's counter to keep counting")
    assert log_state(sb)[1] and sb.execute("cat /root/state")["output"] == "kept\n"


def test_an_action_that_ends_its_sandbox_twice_is_the_agents_outcome(make_env, docker_client):
    env = make_env(checkpoint_policy="never")
    env.reset()
    assert env.step("echo a > /f")[4]["belayer"]["step"] == 1
    obs, _r, terminated, _tr, info = env.step("kill -TERM 1")  # once: could be anything, recovered
    assert info["belayer"]["rollback"] == {"to_step": 0, "reason": "SandboxLost"} and not terminated
    assert env.step("echo a > /f")[4]["belayer"]["step"] == 1  # the agent regenerates boundary 1...
    name = env.name
    obs, reward, terminated, truncated, info = env.step("kill -TERM 1")  # ...and ends it again from there
    assert terminated and not truncated and reward == 0.0, info
    assert info["belayer"]["sandbox_exited"] == {"exit_code": 0, "times": 2} and "rollback" not in info["belayer"]
    assert "ended the sandbox itself" in obs
    assert_no_infra_text(obs)
    assert [s.action for s in env.trajectory.steps] == ["echo a > /f", "kill -TERM 1"]
    assert [e.kind for e in env.trajectory.events].count("sandbox_exited") == 2
    assert not sandbox_containers(docker_client, name), "the ended sandbox was not fenced"
    with pytest.raises(UsageError):
        env.step("true")


def test_an_outside_kill_from_the_same_boundary_is_still_recovered(make_env, docker_client):
    env = make_env(checkpoint_policy="never")
    env.reset()
    for _ in range(2):
        sandbox = env.sandbox
        timer = threading.Timer(0.5, kill_container, args=(docker_client, sandbox.container_id))
        timer.start()
        _obs, _r, terminated, _tr, info = env.step("sleep 10")
        timer.join()
        assert info["belayer"]["rollback"]["to_step"] == 0 and not terminated, info
    assert "sandbox_exited" not in [e.kind for e in env.trajectory.events]


def _leftovers(client, names: list[str]) -> list[Path]:
    """This process's staging dirs in Docker's tmp dir, but staged copies of other sandboxes
    (other tests here call ``prestage`` directly: such a copy stays until used or dropped)."""
    return [d for d in docker_tmp(client).glob(f"{PREFIX}*~{owner_tag()}")
            if not d.name.startswith(STAGED) or any(f"{STAGED}{n}." in d.name for n in names)]


def test_no_staging_left_after_reset_or_close(make_env, docker_client):
    env = make_env(checkpoint_policy="always")
    names = []
    for episode in range(2):  # reset ends episode 0, close ends episode 1
        env.reset()
        names.append(env.name)
        env.step("echo 1 > /f")
        env.settle()
        wait_until(lambda: staged_copies(docker_client, env.name), 60, "the newest checkpoint to be pre-staged")
        env.step("echo 2 > /f")
        env.settle()  # published; its pre-staging starts now and is in flight at the reset/close
        if episode == 0:
            continue
        env.close()
    for name in names:
        assert staged_copies(docker_client, name) == [], f"a pre-staged copy of {name} outlived its env"
    assert _leftovers(docker_client, names) == [], "restore/prestage staging of this process left behind"
