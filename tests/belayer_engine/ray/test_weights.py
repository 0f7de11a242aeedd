"""Weight updates reach engine slots on other Ray nodes, and a slot never serves stale weights.

Three raylets that can each host one slot; the driver (router) on the head. What the new
weights should produce is measured independently: a one-machine ``RecoverableEngine`` gets
the same updates through its arena socket (the documented one-machine weight sync). Every
slot is then asked directly (its worker URL, greedy), so "every slot" means every slot,
not whichever one the router picked.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request

import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(900)
PROMPT_IDS = list(range(5, 29))
NEW_TOKENS = 24


def _weights():
    from belayer_engine.model.config import ModelConfig
    from belayer_engine.model.weights import init_weights

    full = init_weights(ModelConfig(), 1)  # version 1: every weight new
    other = init_weights(ModelConfig(), 2)  # version 2: some weights only (the last layer's MLP, the final norm)
    partial = {k: v for k, v in other.items() if k.startswith("model.layers.3.mlp.") or k == "model.norm.weight"}
    return full, partial


def _generate(url: str, headers: dict[str, str]) -> tuple[list[int], int]:
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                          "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.load(resp)
    return out["output_ids"], out["meta_info"]["weight_version"]


@pytest.fixture(scope="module")
def truth():
    """Greedy output of versions 0, 1, 2 on a one-machine engine given the same updates."""
    from belayer_engine import RecoverableEngine
    from belayer_engine.arena.client import ArenaClient

    full, partial = _weights()
    with RecoverableEngine.launch(shadow=False) as engine:
        url, headers = engine.status()["slots"]["w0"]["worker_url"], engine.worker_headers()
        arena = ArenaClient(engine.arena_socket())
        want = [_generate(url, headers)]
        assert arena.update_weights(full) == 1
        want.append(_generate(url, headers))
        assert arena.update_weights(partial) == 2
        want.append(_generate(url, headers))
    assert [v for _, v in want] == [0, 1, 2], want
    ids = [i for i, _ in want]
    assert ids[0] != ids[1] != ids[2] != ids[0], "the updates must change the greedy output"
    return ids


def _every_slot(engine, only_routed: bool = False) -> dict[str, tuple[list[int], int]]:
    slots = engine.status()["slots"]
    return {name: _generate(s["url"], engine.worker_headers())
            for name, s in slots.items() if s["url"] is not None or not only_routed}


def _routed_since(engine, slot: str, t0: float):
    return next((e for e in engine.events if e["event"] == "routed" and e["slot"] == slot and e["t"] >= t0), None)


def test_update_reaches_every_slot_and_a_cold_restarted_arena_catches_up(cluster, truth):
    import openai
    import ray

    from belayer_core.errors import UsageError
    from belayer_engine.ray import RayEngine, RayEngineConfig

    full, partial = _weights()
    with RayEngine.launch(RayEngineConfig(slots=2)) as engine:
        nodes = {s["where"]["node_id"] for s in engine.status()["slots"].values()}
        assert len(nodes) == 2, engine.status()
        assert _every_slot(engine) == {"r0": (truth[0], 0), "r1": (truth[0], 0)}

        assert engine.update_weights(full) == 1
        assert _every_slot(engine) == {"r0": (truth[1], 1), "r1": (truth[1], 1)}
        for bad, why in (({"nope": full["model.norm.weight"]}, "unknown weight"),
                         ({"model.norm.weight": full["model.norm.weight"][:3]}, "shape")):
            with pytest.raises(UsageError, match=why):  # refused on the driver: nothing sent, no version
                engine.update_weights(bad)
        assert engine.weight_version == 1
        client = openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0)
        reply = client.completions.create(model="m", prompt=PROMPT_IDS, max_tokens=4, temperature=0)
        assert reply.model_extra["belayer"]["weight_version"] == 1, reply.model_extra

        # the arena of r0 dies on a live node: its supervisor cold-restarts it with the
        # seeded weights (version 0); the slot must catch up before it serves again
        t0 = time.monotonic()
        arena_pid = ray.get(engine.slot_actor("r0").status.remote(), timeout=60)["slots"]["w0"]["arena_pid"]
        os.kill(arena_pid, signal.SIGKILL)
        wait_until(lambda: _routed_since(engine, "r0", t0), 180, "r0 serving again after its arena's cold restart")
        assert engine.slots["r0"]["starts"] == 1, "the slot was re-placed, not cold-restarted on its node"
        assert _every_slot(engine) == {"r0": (truth[1], 1), "r1": (truth[1], 1)}

        assert engine.update_weights(partial) == 2  # a patch of some weights: merged on top of version 1
        assert _every_slot(engine) == {"r0": (truth[2], 2), "r1": (truth[2], 2)}


def test_slot_restarted_after_its_node_died_serves_the_newest_version(cluster, truth):
    import ray

    from belayer_engine.ray import RayEngine, RayEngineConfig

    c, nodes = cluster
    full, partial = _weights()
    with RayEngine.launch(RayEngineConfig(slots=2)) as engine:
        assert engine.update_weights(full) == 1
        assert _every_slot(engine) == {"r0": (truth[1], 1), "r1": (truth[1], 1)}
        slots = engine.status()["slots"]
        lost_node = slots["r0"]["where"]["node_id"]
        pids = ray.get(engine.slot_actor("r0").pids.remote(), timeout=60)

        t0 = time.monotonic()
        c.remove_node(next(n for n in nodes if n.node_id == lost_node), allow_graceful=False)
        for pid in pids:  # the machine goes: its processes with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # pushed while r0 is lost or being placed again: whichever comes first, nothing in
        # service may serve version 1 once this returns
        assert engine.update_weights(partial) == 2
        pushed = next(e for e in engine.events if e["event"] == "weights_updated" and e["version"] == 2)
        assert "r1" in pushed["slots"], pushed  # the live slot took it; r0 was lost, failed or caught up
        print("update while r0 was lost:", pushed, [e["event"] for e in engine.events if e["t"] >= t0])
        for name, got in _every_slot(engine, only_routed=True).items():
            assert got == (truth[2], 2), f"slot {name} in service with stale weights after the update returned"

        wait_until(lambda: _routed_since(engine, "r0", t0), 240, "r0 placed again and serving")
        where = engine.status()["slots"]["r0"]["where"]["node_id"]
        assert where != lost_node and engine.slots["r0"]["starts"] == 2, engine.status()
        assert _every_slot(engine) == {"r0": (truth[2], 2), "r1": (truth[2], 2)}
