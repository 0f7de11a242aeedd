"""AReaL, unchanged, against the engine: its own SGLang client survives a SIGKILL (issue 33, item 2).

AReaL 1.0.4 lives in its own venv (``scripts/setup_areal.sh``, run by ``scripts/setup.sh``)
so that its pins never touch the project's; a missing venv fails this test with the set-up
hint. A driver (below) runs in that venv and uses AReaL's own ``RemoteSGLangEngine`` (its
``agenerate`` posts SGLang's ``/generate`` and loops while ``finish_reason`` is ``abort``)
against the engine's router, first fault-free, then while the test SIGKILLs the serving
worker mid-generation. AReaL must see one generation: the same tokens and logprobs, a
``length`` finish, one ``/generate`` POST and one request built (no abort loop, no retry).
The driver only counts HTTP calls (a wrapper around aiohttp's request); it changes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from belayer_engine import RecoverableEngine
from tests.belayer.wrappers.episodes import read_json_line
from tests.belayer_engine.conftest import poll

pytestmark = pytest.mark.timeout(900)

DEFAULT_VENV = "/opt/belayer/areal-venv"
SETUP_HINT = "run `bash scripts/setup_areal.sh` (or set BELAYER_AREAL_VENV to a venv with areal==1.0.4)"
PROMPT = [72, 101, 108, 108, 111, 32, 98, 101, 108, 97, 121]
MAX_NEW = 384
KILL_AT = 8
TOL = 1e-4

DRIVER = r'''
import asyncio, json, sys
import aiohttp
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest
from areal.engine.sglang_remote import RemoteSGLangEngine

addr, prompt, max_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
calls, built = [], []
_request = aiohttp.ClientSession._request

async def counting(self, method, url, *args, **kwargs):  # observes, changes nothing
    calls.append((method, str(url)))
    return await _request(self, method, url, *args, **kwargs)

aiohttp.ClientSession._request = counting
engine = RemoteSGLangEngine(InferenceEngineConfig(experiment_name="belayer", trial_name="areal",
                                                  setup_timeout=120, request_timeout=600))
engine.initialize(addr=[addr], train_data_parallel_size=1)
backend = engine._engine.backend
_build = backend.build_generation_request

def build(*args, **kwargs):
    built.append(1)
    return _build(*args, **kwargs)

backend.build_generation_request = build

def run(phase):
    calls.clear(); built.clear()
    req = ModelRequest(input_ids=list(prompt),
                       gconfig=GenerationHyperparameters(max_new_tokens=max_new, greedy=True, ignore_eos=True))
    out = asyncio.run(engine.agenerate(req))
    print(json.dumps({"phase": phase, "output_tokens": out.output_tokens, "output_logprobs": out.output_logprobs,
                      "stop_reason": out.stop_reason, "output_versions": out.output_versions,
                      "generate_posts": sum(1 for m, u in calls if u.endswith("/generate")),
                      "requests_built": len(built)}), flush=True)

run("fault_free")
print(json.dumps({"phase": "ready"}), flush=True)
sys.stdin.readline()
run("faulted")
engine.destroy()
'''


def areal_python() -> str:
    venv = os.environ.get("BELAYER_AREAL_VENV") or DEFAULT_VENV
    py = Path(venv) / "bin" / "python"
    if not py.is_file():
        pytest.fail(f"AReaL is not installed at {venv}: {SETUP_HINT}")
    return str(py)


def _most_generated(engine) -> int:
    runs = list(engine.router.native.running.values()) if engine.router and engine.router.native else []
    return max((len(r.gen.generated) for r in runs), default=0)


def test_areal_remote_sglang_engine_sees_one_generation_across_a_sigkill(tmp_path):
    python = areal_python()
    with RecoverableEngine.launch(workers=1, shadow=True) as engine:
        engine.wait_ready(timeout=180, stable=True)
        addr = engine.base_url.removesuffix("/v1").removeprefix("http://")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        proc = subprocess.Popen([python, "-c", DRIVER, addr, json.dumps(PROMPT), str(MAX_NEW)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            want = read_json_line(proc, "AReaL")
            assert read_json_line(proc, "AReaL")["phase"] == "ready"
            proc.stdin.write("go\n")
            proc.stdin.flush()
            poll(lambda: _most_generated(engine) >= KILL_AT, 300, f"AReaL's request to reach {KILL_AT} tokens",
                 interval=0.005)
            pid = engine.worker_pid(0)
            os.killpg(pid, signal.SIGKILL)
            got = read_json_line(proc, "AReaL")
            assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        handovers = [e for e in engine.events() if e["event"] == "handover"]
    assert want["stop_reason"] == "length" and len(want["output_tokens"]) == MAX_NEW
    assert handovers and handovers[-1]["path"] == "shadow", handovers
    assert got["output_tokens"] == want["output_tokens"], "AReaL's tokens differ from the fault-free run"
    worst = max(abs(a - b) for a, b in zip(got["output_logprobs"], want["output_logprobs"], strict=True))
    assert worst <= TOL, worst
    assert got["stop_reason"] == "length", got["stop_reason"]  # never "abort": no re-send loop
    assert got["requests_built"] == 1 and got["generate_posts"] == 1, got  # one request, no retry
    print(f"AReaL: worker pid {pid} SIGKILLed at >= {KILL_AT} tokens; {MAX_NEW} tokens equal to the "
          f"fault-free run; max |logprob diff| {worst:.2e}; 1 /generate POST, no abort, no retry")
