"""Engine slots on a real multi-node Ray cluster: a node dies mid-stream, the request completes.

A head (the driver and the router; no slots) and three raylets that can each host one slot
(arena + worker + shadow, real processes). Two slots serve; the node of the slot streaming
a greedy request is lost (its raylet, the slot actor and the slot's processes killed, as a
lost machine would). The client's stream must end token-identical to a fault-free run,
and the lost slot must be placed again on the spare node and serve.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 256  # long enough that the loss at token 10 lands mid-generation
PROMPT = "Tell me about ropes, belays and anchors."


def test_worker_death_hands_over_on_its_node(cluster):
    """A worker killed on a live node: its slot's shadow takes over there (no re-placement)."""
    import openai
    import ray

    from belayer_engine.ray import RayEngine, RayEngineConfig

    with RayEngine.launch(RayEngineConfig(slots=1)) as engine:
        client = openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": PROMPT}]
        extra = {"ignore_eos": True, "return_token_ids": True}
        want = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body=extra).choices[0].model_extra["token_ids"]
        where = engine.status()["slots"]["r0"]["where"]
        status = ray.get(engine.slot_actor("r0").status.remote(), timeout=60)["slots"]["w0"]
        t0, ids, summary, killed = time.monotonic(), [], None, False
        for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS,
                                                    temperature=0, stream=True, extra_body=extra):
            summary = (chunk.model_extra or {}).get("belayer") or summary
            for choice in chunk.choices:
                ids += (choice.model_extra or {}).get("token_ids", [])
            if len(ids) >= 10 and not killed:
                os.kill(status["worker_pid"], signal.SIGKILL)
                killed = True
        assert ids == want and summary["recoveries"] >= 1, summary
        routed = wait_until(lambda: next((e for e in engine.events if e["event"] == "routed" and e["t"] >= t0), None),
                            60, "the shadow routed")
        assert routed["pid"] == status["shadow_pid"], (routed, status)
        assert engine.status()["slots"]["r0"]["where"] == where and engine.slots["r0"]["starts"] == 1


def test_node_loss_mid_stream_token_identical_and_slot_replaced(cluster):
    import openai
    import ray

    from belayer_engine.ray import RayEngine, RayEngineConfig

    c, nodes = cluster
    with RayEngine.launch(RayEngineConfig(slots=2)) as engine:
        client = openai.OpenAI(base_url=engine.base_url, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": PROMPT}]
        extra = {"ignore_eos": True, "return_token_ids": True}
        want = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body=extra)
        want_ids = want.choices[0].model_extra["token_ids"]
        slots = engine.status()["slots"]
        assert len({s["where"]["node_id"] for s in slots.values()}) == 2, slots
        pids = {name: ray.get(engine.slot_actor(name).pids.remote(), timeout=60) for name in slots}

        t0 = time.monotonic()
        ids, text, lost, summary = [], "", None, None
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, extra_body=extra)
        for chunk in stream:
            summary = (chunk.model_extra or {}).get("belayer") or summary
            for choice in chunk.choices:
                ids += (choice.model_extra or {}).get("token_ids", [])
                text += choice.delta.content or ""
            if len(ids) >= 10 and lost is None:
                busy = engine.call(_busy_slot(engine))
                lost = (busy, slots[busy]["where"]["node_id"])
                node = next(n for n in nodes if n.node_id == lost[1])
                c.remove_node(node, allow_graceful=False)  # the machine goes: raylet, actor, processes
                for pid in pids[busy]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        assert lost is not None, "the stream ended before 10 tokens"
        assert ids == want_ids and text == want.choices[0].message.content, "stream not token-identical"
        assert summary and summary["recoveries"] >= 1, f"the loss did not land mid-stream: {summary}"

        gone = engine.wait_event("slot_lost", since=t0, timeout=120)
        assert gone["slot"] == lost[0], gone
        placed = wait_until(lambda: next((e for e in engine.events if e["event"] == "routed" and e["t"] >= t0
                                          and e["slot"] == lost[0]), None), 180, "the lost slot serving again")
        where = engine.status()["slots"][lost[0]]["where"]
        assert where["node_id"] not in (lost[1],), where
        assert placed["url"]
        again = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body=extra)
        assert again.choices[0].model_extra["token_ids"] == want_ids


async def _busy_slot(engine) -> str:
    busy = [e.slot for e in engine.table.endpoints() if e.inflight > 0]
    assert len(busy) == 1, f"expected one slot streaming, got {busy}"
    return busy[0]
