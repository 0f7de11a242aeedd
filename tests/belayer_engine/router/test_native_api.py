"""SGLang's native API on the engine's router, over the reference worker (issue 33, item 1).

Real processes: an engine (arena, worker, shadow) with an API key. Shapes of single,
batched, n > 1 and streamed answers; refusals that name the field; ``/abort_request``; a
real SIGKILL of the serving worker mid-generation, streamed and not, answered as one
generation with the ids and logprobs of the fault-free greedy run and one weight version;
the info, cache and weight-from-disk routes (hostile weight updates:
test_weight_routes.py); an undecodable Authorization header (issue 36, item 8).
The conformance against a real SGLang server is tests/belayer_engine/backends/sglang/
test_sglang_native.py.
"""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

import pytest

from belayer_engine import RecoverableEngine
from belayer_engine.router import RouterConfig

from .native_client import call, generate
from .native_faults import generate_through_a_sigkill

pytestmark = pytest.mark.timeout(600)

KEY = "native-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [72, 101, 108, 108, 111, 32, 98, 101, 108, 97, 121]
LONG = 384  # tokens: the kill lands well inside the generation
KILL_AT = 8
TOL = 1e-4  # the re-prefilled worker sums in another shape; bit-equal on this CPU so far


@pytest.fixture(scope="module")
def engine():
    with RecoverableEngine.launch(workers=1, shadow=True, router=RouterConfig(api_key=KEY)) as eng:
        eng.wait_ready(timeout=180)
        yield eng


def base(engine) -> str:
    return engine.base_url.removesuffix("/v1")


def gen(engine, body: dict):
    status, out = generate(base(engine), body, AUTH)
    assert status == 200, out
    return out


def greedy(max_new: int, **extra) -> dict:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
            **extra}


def test_single_batched_n_and_streamed_answers_have_sglangs_shapes(engine):
    one = gen(engine, greedy(6, return_logprob=True, top_logprobs_num=2, rid="one"))
    meta = one["meta_info"]
    assert meta["id"] == "one" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(one["output_ids"]) == 6
    assert isinstance(meta["weight_version"], str) and meta["weight_versions"] == [
        {"version": meta["weight_version"], "start": 0, "end": 6}]
    assert [e[1] for e in meta["output_token_logprobs"]] == one["output_ids"]
    assert all(isinstance(e[0], float) and e[2] is None for e in meta["output_token_logprobs"])
    assert len(meta["output_top_logprobs"]) == 6 and all(len(row) == 2 for row in meta["output_top_logprobs"])
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 6

    batch = gen(engine, {"input_ids": [PROMPT, PROMPT[:4]], "rid": "b",
                         "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert [b["meta_info"]["id"] for b in batch] == ["b_0", "b_1"]
    assert batch[0]["output_ids"] == one["output_ids"]  # batching changes nothing (greedy)

    n = gen(engine, greedy(6, **{"sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 3, "ignore_eos": True}}))
    assert len(n) == 3 and all(x["output_ids"] == one["output_ids"] for x in n)
    assert len({x["meta_info"]["id"] for x in n}) == 3

    chunks = gen(engine, greedy(6, stream=True, return_logprob=True))
    assert chunks[-1]["output_ids"] == one["output_ids"] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    for a, b in zip(chunks, chunks[1:], strict=False):  # cumulative, as SGLang sends them
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert len(b["meta_info"]["output_token_logprobs"]) == len(b["output_ids"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])

    streamed_batch = gen(engine, {"input_ids": [PROMPT, PROMPT], "stream": True,
                                  "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    finals = {c["index"]: c for c in streamed_batch if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1] and all(f["output_ids"] == one["output_ids"][:4] for f in finals.values())


def test_stops_end_where_sglang_ends(engine):
    ref = gen(engine, greedy(12))["output_ids"]
    out = gen(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                "stop_token_ids": [ref[3]]}})
    assert out["output_ids"] == ref[:4] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[3]}
    ref = gen(engine, greedy(64))["output_ids"]
    printable = [i for i, t in enumerate(ref) if 32 <= t < 127]  # a printable byte: a one-character stop
    assert printable, f"no printable byte in the greedy answer {ref}"
    at = printable[0]
    out = gen(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 64, "temperature": 0,
                                                                "stop": [chr(ref[at])]}})
    assert out["output_ids"] == ref[: at + 1] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": chr(ref[at])}
    assert chr(ref[at]) not in out["text"]  # trimmed, as SGLang trims unless no_stop_trim
    text = gen(engine, {"text": "Hello belay", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert text["meta_info"]["prompt_tokens"] == len("Hello belay")


@pytest.mark.parametrize(("body", "field"), [
    ({"input_ids": PROMPT, "image_data": "x.png"}, "image_data"),
    ({"input_ids": PROMPT, "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"input_ids": PROMPT, "sampling_params": {"top_p": 5}}, "top_p"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ({"input_ids": PROMPT, "logprob_start_len": 0, "return_logprob": True}, "logprob_start_len"),
    ({"input_ids": PROMPT, "lora_path": "adapter"}, "lora_path"),
    ({"input_ids": PROMPT, "made_up": 1}, "made_up"),
    ({"text": "x", "input_ids": PROMPT}, "input_ids"),
    ({"input_ids": [[1], []]}, "prompt 1"),
    ({"input_ids": PROMPT, "sampling_params": {"n": 0}}, "n"),
])
def test_an_unsupported_or_bad_field_is_a_400_naming_it(engine, body, field):
    status, out = generate(base(engine), body, AUTH)
    assert status == 400 and field in out["error"]["message"], out


def test_neutral_values_of_unimplemented_fields_are_accepted(engine):
    """AReaL sends ``image_data: null`` and ``frequency_penalty: 0.0`` with every request."""
    out = gen(engine, {"input_ids": PROMPT, "image_data": None, "return_logprob": True, "stream": False,
                       "sampling_params": {"max_new_tokens": 2, "temperature": 0.0, "frequency_penalty": 0.0,
                                           "top_k": -1, "top_p": 1.0, "stop_token_ids": [], "ignore_eos": False,
                                           "skip_special_tokens": True}})
    assert len(out["output_ids"]) == 2


def test_abort_request_ends_the_generation_with_what_it_has(engine):
    body = greedy(LONG, rid="to-abort")

    status, out, _ = _abort_after(engine, body)
    assert status == 200, out
    assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
    assert KILL_AT <= len(out["output_ids"]) < LONG
    assert call(base(engine), "POST", "/abort_request", {"rid": 3}, AUTH)[0] == 400


def test_pause_and_continue_generation_as_areal_uses_them(engine):
    """AReaL pauses (``{}``: mode abort) around a weight update and continues after it."""
    import threading

    from tests.belayer_engine.conftest import poll

    status, out, _ = _abort_after(engine, greedy(LONG, rid="paused"), path="/pause_generation", control_body={})
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
    held: dict = {}
    t = threading.Thread(target=lambda: held.update(out=generate(base(engine), greedy(4), AUTH)), daemon=True)
    t.start()
    poll(lambda: engine.router.native.held == 1, 60, "the new request to wait for /continue_generation")
    assert call(base(engine), "POST", "/continue_generation", {}, AUTH)[0] == 200
    t.join(120)
    assert held["out"][0] == 200 and len(held["out"][1]["output_ids"]) == 4
    assert call(base(engine), "POST", "/pause_generation", {"mode": "later"}, AUTH)[0] == 400


def _abort_after(engine, body, path="/abort_request", **kw):
    import threading

    from tests.belayer_engine.conftest import poll

    from .native_faults import generated_so_far

    result = {}
    t = threading.Thread(target=lambda: result.update(out=generate(base(engine), body, AUTH)), daemon=True)
    t.start()
    poll(lambda: generated_so_far(engine, body["rid"]) >= KILL_AT, 120, "tokens to abort", interval=0.005)
    assert call(base(engine), "POST", path, kw.get("control_body", {"rid": body["rid"]}), AUTH)[0] == 200
    t.join(120)
    return (*result["out"], None)


@pytest.mark.parametrize("stream", [False, True])
def test_sigkill_mid_generation_is_one_generation_equal_to_the_fault_free_one(engine, stream):
    engine.wait_ready(timeout=180, stable=True)
    want = gen(engine, greedy(LONG, return_logprob=True, top_logprobs_num=2))
    body = greedy(LONG, return_logprob=True, top_logprobs_num=2, rid=f"kill-{stream}", stream=stream)
    status, out, pid = generate_through_a_sigkill(engine, base(engine), body, KILL_AT, AUTH)
    assert status == 200, out
    final = out[-1] if stream else out
    if stream:
        assert all(c["meta_info"]["finish_reason"] is None for c in out[:-1])
        for a, b in zip(out, out[1:], strict=False):
            assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"], "a chunk went back"
    meta, ref = final["meta_info"], want["meta_info"]
    assert final["output_ids"] == want["output_ids"], meta["belayer"]
    assert meta["belayer"]["recoveries"] == 1 and KILL_AT <= meta["belayer"]["failures"][0]["at_token"] < LONG
    got = [e[0] for e in meta["output_token_logprobs"]]
    exp = [e[0] for e in ref["output_token_logprobs"]]
    assert len(got) == LONG and [e[1] for e in meta["output_token_logprobs"]] == want["output_ids"]
    worst = max(abs(a - b) for a, b in zip(got, exp, strict=True))
    assert worst <= TOL, worst
    assert [[t[1] for t in row] for row in meta["output_top_logprobs"]] == [[t[1] for t in row] for row in ref["output_top_logprobs"]]
    assert meta["weight_versions"] == ref["weight_versions"] and len(meta["weight_versions"]) == 1
    assert meta["finish_reason"] == {"type": "length", "length": LONG}
    engine.wait_event("handover", 0, 120)
    print(f"stream={stream}: killed pid {pid} at token >= {KILL_AT}; {LONG} ids equal; max |logprob diff| {worst:.2e}")


def test_info_health_and_cache_routes(engine):
    b = base(engine)
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        status, out = call(b, "GET", path, headers=AUTH)
        assert status == 200 and isinstance(out["weight_version"], str), (path, out)
    assert call(b, "GET", "/health_generate", headers=AUTH)[0] == 200
    assert call(b, "GET", "/health")[0] == 200
    assert call(b, "POST", "/flush_cache", headers=AUTH)[0] == 200
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        status, out = call(b, "POST", path, {}, AUTH)
        assert status == 501 and "not served" in str(out), (path, out)
    assert call(b, "GET", "/model_info")[0] == 401  # the key guards the native routes too


def test_update_weights_from_disk_is_one_engine_wide_version(engine, tmp_path):
    import torch
    from safetensors.torch import save_file

    before = gen(engine, greedy(12))
    layout, dtype = engine.call(engine.supervisor.weight_layout())
    name = "lm_head.weight" if "lm_head.weight" in layout else "model.embed_tokens.weight"
    head = torch.randn(layout[name], generator=torch.Generator().manual_seed(7))  # every argmax moves
    save_file({name: head}, str(tmp_path / "model.safetensors"))
    status, out = call(base(engine), "POST", "/update_weights_from_disk",
                       {"model_path": str(tmp_path), "weight_version": "7", "flush_cache": True}, AUTH)
    assert status == 200 and out["success"] and "7" in out["message"], out
    after = gen(engine, greedy(12))
    assert after["meta_info"]["weight_version"] == "7" and after["output_ids"] != before["output_ids"]
    assert engine.call(engine.supervisor.weight_sync._arena_version(engine.supervisor.slots[0])) == 7
    status, out = call(base(engine), "POST", "/update_weights_from_disk",  # AReaL's body, as it sends it
                       {"model_path": str(tmp_path), "abort_all_requests": True}, AUTH)
    assert status == 200 and out["success"] and "8" in out["message"], out
    status, out = call(base(engine), "POST", "/update_weights_from_disk",
                       {"model_path": str(tmp_path), "weight_version": "3"}, AUTH)
    assert status == 409 and not out["success"], out  # not newer than 7
    status, out = call(base(engine), "POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "none")}, AUTH)
    assert status == 400 and "safetensors" in out["message"], out


def _raw_get(url: str, path: str, authorization: bytes) -> int:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.putrequest("GET", path)
        conn.putheader("Authorization", authorization)
        conn.endheaders()
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_an_undecodable_authorization_header_is_a_401_not_a_500(engine):
    """Issue 36, item 8: ``Bearer \\xff\\xfe`` used to raise inside the key check."""
    bad = b"Bearer \xff\xfe"
    assert _raw_get(base(engine), "/v1/models", bad) == 401
    assert _raw_get(base(engine), "/model_info", bad) == 401
    worker = engine.status()["slots"]["w0"]["worker_url"]
    assert _raw_get(worker, "/get_server_info", bad) == 401
    assert _raw_get(base(engine), "/v1/models", f"Bearer {KEY}".encode()) == 200
