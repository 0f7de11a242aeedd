"""Episodes on a real multi-node Ray cluster survive the loss of a node.

Each episode appends its step number to /tmp/log and bumps a counter held only in a
background process's memory, once per committed step. A node is lost in the middle of the
episodes (raylet, env actor processes and their containers killed); every episode must
still finish, continued on the other node from its newest *replicated* checkpoint, with
the rollback in ``info`` as for any failure, and end with a log and a counter equal to its
committed prefix: nothing lost, nothing replayed, runtime state included.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

from belayer_env.env.recoverable import SUBMIT_MARKER, EnvConfig
from belayer_env.ray import EpisodePool, RayEnvConfig, RayVectorEnv
from belayer_env.sandbox.config import SandboxConfig
from tests.belayer_env.env.test_env_recovery import BUMP, COUNTER
from tests.belayer_env.ray.conftest import lose_node

pytestmark = pytest.mark.timeout(600)

SETUP = ["touch /tmp/log", COUNTER]
FINAL = f"echo {SUBMIT_MARKER}; tr '\\n' ' ' < /tmp/log; echo; cat /tmp/n"
EPISODES, AFTER_LOSS = 4, 8  # >= 8 s of steps after the loss: the victims are mid-call when it lands
WAIT_S = 150  # bound on every wait below (a loaded 2-core machine; typically far less)


def action(k: int, slow: bool = False) -> str:
    """Step k: append k to the log and bump the in-memory counter to k (it prints it)."""
    return f"echo {k} >> /tmp/log; {BUMP.format(n=k)}" + ("; sleep 1" if slow else "")


def expected_submission(k: int) -> str:
    return " ".join(str(i) for i in range(1, k + 1)) + " \n" + str(k)


def config(tmp_path: Path, policy: str = "always") -> RayEnvConfig:
    sandbox = SandboxConfig(memory="256m", cpus=0.5, name_prefix="belayer-raytest")
    return RayEnvConfig(replica_url=(tmp_path / "replica").as_uri(), checkpoint_policy=policy,
                        env=EnvConfig(sandbox=sandbox), start_timeout_s=WAIT_S, call_timeout_s=WAIT_S)


def test_vector_env_steps_in_parallel_and_autoresets(ray_cluster, tmp_path):
    envs = RayVectorEnv(2, config(tmp_path, policy="never"),
                        autoreset_options=lambda i: {"task": f"next-{i}", "setup": "echo fresh > /tmp/f"})
    try:
        obs, infos = envs.reset(options=[{"task": "t0"}, {"task": "t1", "setup": "echo base > /tmp/f"}])
        assert obs == ("t0", "t1") and list(infos["belayer"]["step"]) == [0, 0]
        assert envs.observation_space.contains(obs)
        obs, rewards, term, trunc, infos = envs.step([f"echo {SUBMIT_MARKER}", "cat /tmp/f"])
        assert list(term) == [True, False] and not trunc.any() and obs[1].endswith("base\n</output>")
        assert infos["submission"][0] == "" and list(infos["_submission"]) == [True, False]
        # NEXT_STEP autoreset: sub-env 0 is reset (its action ignored), sub-env 1 steps
        obs, rewards, term, trunc, infos = envs.step(["echo ignored > /tmp/x", "echo 2"])
        assert obs[0] == "next-0" and list(infos["belayer"]["step"]) == [0, 2] and not term.any()
        obs = envs.step(["cat /tmp/f; ls /tmp/x 2>&1", "echo 3"])[0]
        assert "fresh" in obs[0] and "No such file" in obs[0], obs[0]
        nodes = {e.where["node_id"] for e in envs.envs}
        assert len(nodes) == 2, "SPREAD placed both sub-envs on one node"
    finally:
        envs.close()


def test_pool_reads_episodes_lazily_and_bounds_concurrency(ray_cluster, tmp_path):
    lock, state, yielded = threading.Lock(), {"pulled": 0, "running": 0, "peak": 0}, []

    def episodes():
        for i in range(5):
            with lock:  # taken only when a slot is free: never more than 2 ahead of the results
                assert state["pulled"] - len(yielded) < 2, (state, len(yielded))
                state["pulled"] += 1
            yield {"task": f"lazy-{i}"}

    def agent(env, episode):
        with lock:
            state["running"] += 1
            state["peak"] = max(state["peak"], state["running"])
        try:
            env.reset(options=episode)
            return env.step(f"echo {episode['task']}")[0]
        finally:
            with lock:
                state["running"] -= 1

    with EpisodePool(config(tmp_path, policy="never"), max_concurrent=2) as pool:
        for r in pool.run(episodes(), agent):
            assert r.error is None and r.value.endswith(f"{r.episode['task']}\n</output>"), r
            yielded.append(r)
        assert len(pool.envs) == 2, "the pool did not reuse its env actors"
    assert len(yielded) == 5 and state["peak"] <= 2, state


def test_node_loss_mid_episode_resumes_from_replicated_checkpoints(ray_cluster, tmp_path, docker_client):
    cluster, nodes = ray_cluster
    paused = threading.Semaphore(0)
    go = threading.Event()
    seen: dict[str, dict] = {}

    def agent(env, episode):
        obs, info = env.reset(options=episode)
        k, rollbacks = 0, []
        # run until a replicated checkpoint of boundary >= 2 exists, then wait for the loss
        while env.resume_point is None or env.resume_point["step"] < 2:
            obs, _, _, _, info = env.step(action(k + 1))
            assert "rollback" not in info["belayer"], info
            k = info["belayer"]["step"]
            assert k < 30, f"no replicated checkpoint after {k} steps ({episode['task']})"
        seen[episode["task"]] = {"where": dict(env.where), "point": dict(env.resume_point), "k": k}
        paused.release()
        assert go.wait(WAIT_S), "the test never lost the node"
        target = k + AFTER_LOSS
        while True:
            obs, _, terminated, _, info = env.step(action(k + 1, slow=True) if k < target else FINAL)
            if "rollback" in info["belayer"]:  # the agent cuts its context there and regenerates
                rollbacks.append({**info["belayer"]["rollback"], "from": k})
                k = info["belayer"]["step"]
                continue
            if terminated:
                return {"k": k, "submission": info["submission"], "rollbacks": rollbacks}
            assert obs.endswith(f"\n{k + 1}</output>"), f"counter off after step {k + 1}: {obs[-200:]}"
            k = info["belayer"]["step"]

    episodes = [{"task": f"episode-{i}", "setup": SETUP} for i in range(EPISODES)]
    finished: list = []
    with EpisodePool(config(tmp_path), max_concurrent=EPISODES) as pool:
        collector = threading.Thread(target=lambda: finished.extend(pool.run(episodes, agent)), daemon=True)
        collector.start()
        for _ in range(EPISODES):
            assert paused.acquire(timeout=WAIT_S), (
                f"episodes stuck before the loss (paused: {sorted(seen)}; ended: "
                f"{[(r.episode['task'], repr(r.error)) for r in finished]})")
        by_node = Counter(s["where"]["node_id"] for s in seen.values())
        assert len(by_node) == 2, f"episodes not spread over both nodes: {by_node}"
        victim = next(n for n in nodes if n.node_id == by_node.most_common(1)[0][0])
        lost = {t for t, s in seen.items() if s["where"]["node_id"] == victim.node_id}
        go.set()
        killed = lose_node(cluster, victim, [seen[t]["where"]["pid"] for t in lost], docker_client)
        assert killed, "the lost node's containers were not found by their owner labels"
        collector.join(WAIT_S)
        assert not collector.is_alive(), f"episodes did not finish after the loss (done: {len(finished)})"
        done = {r.episode["task"]: r for r in finished}

    for task, r in done.items():
        assert r.error is None, f"{task} failed: {r.error!r}"
        v = r.value
        # prefix-consistent: the log and the in-memory counter hold exactly steps 1..k
        assert v["submission"] == expected_submission(v["k"]), (task, v)
        if task in lost:
            point = seen[task]["point"]
            assert [f["lost"]["node_id"] for f in r.failovers] == [victim.node_id], r.failovers
            assert r.failovers[0]["now"]["node_id"] != victim.node_id and r.failovers[0]["node_dead"]
            rb = v["rollbacks"]
            assert len(rb) == 1 and rb[0]["reason"] == "NodeLost", rb
            # from the newest replicated checkpoint the driver knew, never boundary 0
            assert point["step"] <= rb[0]["to_step"] <= rb[0]["from"] and rb[0]["to_step"] >= 2, (rb, point)
        else:
            assert not v["rollbacks"] and not r.failovers, (task, v, r.failovers)
    left = list((tmp_path / "replica").rglob("*.ready.json"))
    assert not left, f"closed episodes left replicas behind: {left}"


def test_reset_places_again_an_actor_lost_to_a_node_ray_still_thinks_alive(ray_cluster, tmp_path):
    """A machine that stops answering stays "alive" to Ray until its health checks run out;
    an actor placed there in that window dies before it starts (what CI once saw after a
    node loss). The env must place a new actor, not give the episode up."""
    import os
    import signal

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from belayer_env.ray import SANDBOX_RESOURCE
    from belayer_env.ray.remote_env import RemoteSandboxEnv
    from tests.belayer_env.ray.conftest import node_alive

    cluster, _ = ray_cluster
    first = RemoteSandboxEnv(config(tmp_path, policy="never"))
    spaces = (first.observation_space, first.action_space)
    first.close()
    dying = cluster.add_node(num_cpus=1, resources={SANDBOX_RESOURCE: 1})
    cluster.wait_for_nodes(timeout=120)
    raylet = dying.all_processes["raylet"][0].process
    # soft affinity: the dying node while Ray thinks it alive, any other node once it is dead
    prefer = {"scheduling_strategy": NodeAffinitySchedulingStrategy(dying.node_id, soft=True)}
    env = RemoteSandboxEnv(config(tmp_path, policy="never").model_copy(update={"actor_options": prefer}),
                           spaces=spaces)
    try:
        os.kill(raylet.pid, signal.SIGSTOP)  # the machine hangs: Ray finds out by its health checks
        assert node_alive(dying.node_id), "Ray saw the node dead before the actor was placed"
        obs, info = env.reset(options={"task": "placed-again", "setup": "echo here > /tmp/f"})
        assert obs == "placed-again" and info["belayer"]["step"] == 0
        assert not node_alive(dying.node_id) and env.where["node_id"] != dying.node_id, env.where
        assert env.step("cat /tmp/f")[0].endswith("here\n</output>")
    finally:
        env.close()
        cluster.remove_node(dying, allow_graceful=False)
