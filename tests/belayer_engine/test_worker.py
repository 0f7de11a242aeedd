"""Arena-backed worker processes over HTTP: exact tokens, faults, updates, shadow handover."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import subprocess
import threading

import pytest
import torch

from belayer_engine.backends.reference.dense import greedy_generate
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import init_weights

from .conftest import Arena, Worker, poll

torch.set_num_threads(1)
CFG = ModelConfig()
PROMPTS = [[258, 117, 115, 101, 114, 10, 104, 105, 259, 10, 258, 97],
           [1, 2, 3, 4, 5, 6, 7],
           [300, 12, 99, 7, 7, 7, 45, 200, 201, 202, 203, 204, 205, 206, 207]]
N = 12


@pytest.fixture(scope="module")
def reference():
    w = init_weights(CFG, 0)
    return [greedy_generate(CFG, w, p, N) for p in PROMPTS]


def ids(out: dict) -> list[int]:
    return out["output_ids"]


def test_greedy_equals_dense_alone_and_concurrent(shared_worker, reference):
    w = shared_worker
    for p, ref in zip(PROMPTS, reference, strict=True):
        assert ids(w.generate(p, N, ignore_eos=True)) == ref
    results = [None] * (3 * len(PROMPTS))

    def go(i):
        results[i] = ids(w.generate(PROMPTS[i % 3], N, ignore_eos=True))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [reference[i % 3] for i in range(len(results))]


def test_reprefill_continuation_over_http(shared_worker, reference):
    w = shared_worker
    for p, ref in zip(PROMPTS, reference, strict=True):
        for i in (1, 5, N - 1):
            out = w.generate(p + ref[:i], N - i, ignore_eos=True)
            assert ids(out) == ref[i:]
            assert out["meta_info"]["prompt_tokens"] == len(p) + i


def test_streaming_chunks(shared_worker, reference):
    events = shared_worker.stream({"input_ids": PROMPTS[1], "rid": "s1", "sampling_params": {
        "max_new_tokens": N, "temperature": 0, "ignore_eos": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["output_ids"] for c in chunks] == [reference[1][: k + 1] for k in range(N)]
    assert all(c["meta_info"]["id"] == "s1" for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": N}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["weight_version"] == 0


def test_text_prompt_and_stop_conditions(shared_worker, reference):
    w = shared_worker
    stop_tok = reference[1][3]
    out = w.generate(PROMPTS[1], N, stop_token_ids=[stop_tok], ignore_eos=True)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert ids(out) == reference[1][: reference[1].index(stop_tok) + 1]
    status, out = w.post("/generate", {"text": "<|im_start|>user\nhi", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}})
    assert status == 200 and out["meta_info"]["prompt_tokens"] == 8 and isinstance(out["text"], str)


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"sampling_params": {}}', 400, "exactly one of"),
    (b'{"input_ids": [1], "text": "x"}', 400, "exactly one of"),
    (b'{"input_ids": []}', 400, "empty"),
    (b'{"input_ids": [1, 99999]}', 400, "out of range"),
    (b'{"input_ids": "abc"}', 400, "input_ids"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -3}}', 400, "max_new_tokens"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 2}}', 400, "top_p"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 100000}}', 400, "exceeds"),
])
def test_malformed_requests_get_4xx_and_worker_keeps_serving(shared_worker, reference, body,
                                                             status, needle):
    got, out = shared_worker.post("/generate", raw=body)
    assert got == status and needle in out["error"]["message"], out
    assert ids(shared_worker.generate(PROMPTS[0], N, ignore_eos=True)) == reference[0]


def test_info_routes_abort_and_flush(shared_worker):
    w = shared_worker
    assert w.get("/health") == (200, {"status": "ok", "weight_version": 0})
    status, info = w.get("/get_model_info")
    assert status == 200 and info["is_generation"] and info["model"]["vocab_size"] == 512
    status, info = w.get("/get_server_info")
    assert status == 200 and info["state"] == "active" and info["device"] == "cpu"
    assert w.post("/abort_request", {"rid": "nothing-running"})[0] == 200
    assert w.post("/abort_request", {"abort_all": True})[0] == 200
    assert w.post("/abort_request", raw=b"[]")[0] == 400
    assert w.post("/flush_cache")[0] == 200


def test_abort_ends_a_running_stream(shared_worker):
    w = shared_worker
    result = {}

    def run():
        result["events"] = w.stream({"input_ids": [1, 2, 3], "rid": "long", "sampling_params": {
            "max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    poll(lambda: w.get("/get_server_info")[1]["running"] == 1, 30, "the long request to run")
    assert w.post("/abort_request", {"rid": "long"}) == (200, {"aborted": ["long"], "found": True})
    t.join(30)
    final = result["events"][-2]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(final["output_ids"]) < 3000


def test_sigkill_keeps_arena_memory_and_new_worker_matches(tmp_path, procs, reference):
    arena = Arena(tmp_path)
    procs.append(arena)
    w1 = Worker(arena, tmp_path, name="victim")
    procs.append(w1)
    assert ids(w1.generate(PROMPTS[2], N, ignore_eos=True)) == reference[2]
    sums = arena.client.checksums()

    def doomed_stream():
        try:
            w1.stream({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3000,
                                                                 "ignore_eos": True}})
        except Exception:
            pass  # the stream breaks when the worker is killed: that is the point

    threading.Thread(target=doomed_stream, daemon=True).start()
    poll(lambda: w1.get("/get_server_info")[1]["running"] == 1, 30, "a request in flight")
    w1.kill9()
    after = arena.client.checksums()
    assert after["w0"] == sums["w0"] and after["w1"] == sums["w1"]  # weights intact
    poll(lambda: not arena.client.health()["attached"], 10, "arena to drop the dead worker")
    w2 = Worker(arena, tmp_path, name="replacement")
    procs.append(w2)
    assert [ids(w2.generate(p, N, ignore_eos=True)) for p in PROMPTS] == reference
    arena.kill9()  # now the owner dies: the worker must stop claiming health
    poll(lambda: w2.get("/health") == (503, {"status": "arena_lost", "error": {
        "message": "the arena server is gone"}}), 10, "worker to report the lost arena")
    assert w2.post("/generate", {"input_ids": [1]})[0] == 503


def test_weight_update_changes_version_and_tokens(tmp_path, procs, reference):
    arena = Arena(tmp_path)
    procs.append(arena)
    w = Worker(arena, tmp_path, name="upd")
    procs.append(w)
    new = init_weights(CFG, 1)
    expect_new = greedy_generate(CFG, new, PROMPTS[0], N)
    assert expect_new != reference[0]
    assert arena.client.update_weights(new) == 1
    out = w.generate(PROMPTS[0], N, ignore_eos=True)  # sent after update_weights returned
    assert ids(out) == expect_new and out["meta_info"]["weight_version"] == 1
    assert w.get("/belayer/state")[1]["weight_version"] == 1
    assert arena.client.update_weights(init_weights(CFG, 0)) == 2
    out = w.generate(PROMPTS[0], N, ignore_eos=True)
    assert ids(out) == reference[0] and out["meta_info"]["weight_version"] == 2


def test_shadow_refuses_until_activated_then_serves_identically(tmp_path, procs, reference):
    arena = Arena(tmp_path, "--lease-wait-s", "0.3")
    procs.append(arena)
    live = Worker(arena, tmp_path, name="live")
    procs.append(live)
    assert ids(live.generate(PROMPTS[1], N, ignore_eos=True)) == reference[1]
    kv_before = arena.client.checksums()
    shadow = Worker(arena, tmp_path, "--shadow", name="shadow")
    procs.append(shadow)
    after = arena.client.checksums()
    assert after["kv"] == kv_before["kv"], "a shadow must not write live KV"
    d = arena.client.describe()
    nbytes = d["regions"]["kv"]["nbytes"] * d["kv"]["scratch_blocks"] // (
        d["kv"]["num_blocks"] + d["kv"]["scratch_blocks"])
    assert after["scratch"] != hashlib.sha256(bytes(nbytes)).hexdigest(), "warm-up: scratch"
    assert shadow.get("/health") == (503, shadow.get("/health")[1])
    assert shadow.get("/health")[1]["status"] == "shadow"
    assert shadow.post("/generate", {"input_ids": [1]})[0] == 503
    assert shadow.get("/health_generate")[0] == 503
    status, state = shadow.get("/belayer/state")
    assert status == 200 and state["state"] == "shadow" and state["worker_id"] == "shadow"
    status, out = shadow.post("/belayer/activate")  # old worker still alive: fenced out
    assert status == 409 and "held by live" in out["error"]["message"]
    live.kill9()
    status, out = shadow.post("/belayer/activate")
    # how fast is benchmarks/engine_handover.py's to measure: a CI machine under load took over 1 s
    assert status == 200 and out["status"] == "active" and out["activate_s"] >= 0
    assert shadow.get("/belayer/state")[1]["state"] == "active"
    assert shadow.get("/health")[0] == 200
    assert [ids(shadow.generate(p, N, ignore_eos=True)) for p in PROMPTS] == reference
    assert shadow.post("/belayer/activate")[0] == 200  # idempotent


def test_a_weight_update_while_the_shadow_waits_for_the_kv_lease_stalls_neither(tmp_path, procs):
    """A shadow activating while the old worker still holds the KV lease confirms a weight
    version pushed meanwhile, and activates once the lease frees: the lease's reply queues
    behind that push on the shadow's arena connection. (An activation holding the worker's
    state lock across that wait blocked the push's handler: the update waited for the shadow,
    the activation for its reply, until the 30 s timeouts; a CI run fell back to a cold start.)"""
    arena = Arena(tmp_path, "--lease-wait-s", "120")
    procs.append(arena)
    live = Worker(arena, tmp_path, name="live")
    procs.append(live)
    shadow = Worker(arena, tmp_path, "--shadow", name="shadow")
    procs.append(shadow)
    activation: dict = {}
    activating = threading.Thread(target=lambda: activation.update(answer=shadow.post("/belayer/activate")))
    activating.start()
    poll(lambda: any(a["worker_id"] == "shadow" and a["kv_waiting"] for a in arena.client.health()["attached"]),
         60, "the shadow waiting for the KV lease")
    norm = init_weights(ModelConfig(), 5)["model.norm.weight"]
    update: dict = {}
    updating = threading.Thread(target=lambda: update.update(version=arena.client.update_weights({"model.norm.weight": norm})))
    updating.start()
    # the live worker's confirmation is read only after the arena has pushed the version to both
    poll(lambda: any(a["worker_id"] == "live" and a["version"] == 1 for a in arena.client.health()["attached"]),
         60, "the live worker serving version 1")
    assert activating.is_alive(), "the activation still waits for the lease"
    live.kill9()  # the lease frees: its reply reaches the shadow behind the version push
    activating.join(60)
    updating.join(60)
    assert not activating.is_alive() and not updating.is_alive(), "activation and update ended"
    assert update.get("version") == 1, "every worker confirmed the update"
    status, out = activation["answer"]
    assert status == 200 and out["status"] == "active", out
    _, state = shadow.get("/belayer/state")
    assert state["state"] == "active" and state["weight_version"] == 1, state


# What a background job of a shell script (``cmd &`` without job control) gets, and so every
# child of an engine started that way: SIGINT ignored, kept across exec.
SIGINT_IGNORED = ("-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_sigint_drains_the_running_stream_and_exits_zero(tmp_path, procs, inherited):
    """SIGINT mid-stream: the stream still ends complete and exact, then the worker exits 0 -
    also when it inherited SIGINT ignored (it used to keep serving then: no drain, no exit, so
    the supervisor never replaced it)."""
    n = 48
    want = greedy_generate(CFG, init_weights(CFG, 0), PROMPTS[1], n)
    arena = Arena(tmp_path)
    procs.append(arena)
    w = Worker(arena, tmp_path, launcher=SIGINT_IGNORED if inherited == "ignored" else ())
    procs.append(w)
    conn = http.client.HTTPConnection("127.0.0.1", w.port, timeout=60)
    conn.request("POST", "/generate", body=json.dumps({"input_ids": PROMPTS[1], "stream": True, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}}))
    resp = conn.getresponse()
    assert resp.status == 200
    chunks, signalled = [], False
    while line := resp.readline():
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            chunks.append(json.loads(line[len(b"data: "):]))
            if not signalled:
                os.kill(w.pid, signal.SIGINT)
                signalled = True
    conn.close()
    assert chunks and chunks[-1]["output_ids"] == want, "the drained stream must end complete and exact"
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    try:
        code = w.p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker still running 60 s after SIGINT:\n{w.output()}")
    assert code == 0, w.output()
    assert '"event": "draining"' in w.output() and '"event": "drained"' in w.output(), w.output()
