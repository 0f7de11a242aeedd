"""Replay recovery's parts: the logit processor that forces ids, loaded the way SGLang loads
it (dill, in SGLang's own environment), and how an engine picks the recovery for its workers.
The replay itself, through real SGLang servers and a SIGKILL, is test_sglang_engine's."""

from __future__ import annotations

import json
import subprocess

import pytest

from belayer_core.errors import ConfigError
from belayer_engine.backends.sglang.launcher import venv_python
from belayer_engine.lifecycle import PROCESSOR_FLAG, engine_recovery
from belayer_engine.router import RouterConfig
from belayer_engine.router.forced_decode import FORCED_IDS, processor_string, replay_fields
from belayer_engine.supervisor.config import SupervisorConfig

# Run by SGLang's interpreter: SGLang's own loader (dill) makes the processor, then it is
# called as SGLang's sampler calls it: the rows of one batch, one call per sampling step.
SGLANG_SIDE = """
import json, sys
import dill, torch
spec = json.loads(sys.stdin.read())
processor = dill.loads(bytes.fromhex(json.loads(spec["processor"])["callable"]))()
params = spec["params"]
class Req:  # what SGLang adds as params["__req__"]
    is_chunked = 0
chunked = Req(); chunked.is_chunked = 1
for p in params:
    if p is not None:
        p["__req__"] = Req()
picked = []
for step in range(spec["steps"]):
    if step == spec["chunk_step"]:  # row 0 prefills an intermediate chunk at this step
        params[0]["__req__"] = chunked
    logits = torch.arange(spec["vocab"], dtype=torch.float32).repeat(len(params), 1)  # argmax: the last id
    out = processor(logits, params)
    picked.append(out.argmax(-1).tolist())
    params[0]["__req__"] = Req()
print(json.dumps(picked))
"""


def _run_in_sglang(params: list, steps: int, chunk_step: int = -1, vocab: int = 50) -> list[list[int]]:
    spec = {"processor": processor_string(), "params": params, "steps": steps, "chunk_step": chunk_step,
            "vocab": vocab}
    out = subprocess.run([str(venv_python()), "-c", SGLANG_SIDE], input=json.dumps(spec), capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_sglangs_loader_gets_a_processor_that_forces_each_row_its_own_ids_in_order():
    forced_a, forced_b = [7, 3, 11], [5]
    picked = _run_in_sglang([{FORCED_IDS: forced_a}, None, {FORCED_IDS: forced_b}, {"other": 1}], steps=5)
    # rows without forced ids keep their logits (argmax 49); forced rows pass through after their ids
    assert [row[0] for row in picked] == [7, 3, 11, 49, 49]
    assert [row[1] for row in picked] == [49] * 5
    assert [row[2] for row in picked] == [5, 49, 49, 49, 49]
    assert [row[3] for row in picked] == [49] * 5


def test_an_intermediate_prefill_chunk_samples_nothing_and_is_not_counted():
    picked = _run_in_sglang([{FORCED_IDS: [1, 2]}], steps=4, chunk_step=0)
    assert [row[0] for row in picked] == [49, 1, 2, 49]


def test_replay_fields_carry_the_processor_and_a_copy_of_the_ids():
    generated = [4, 5, 6]
    body, sampling = replay_fields(generated)
    generated.append(7)
    assert body == {"custom_logit_processor": processor_string()}
    assert sampling == {"custom_params": {FORCED_IDS: [4, 5, 6]}}
    assert set(json.loads(body["custom_logit_processor"])) == {"callable"}


def test_an_sglang_engine_in_deterministic_mode_replays_and_enables_the_processor():
    sup = SupervisorConfig(backend="sglang", worker_args=["--enable-deterministic-inference"])
    router, sup2 = engine_recovery(RouterConfig(), sup)
    assert router.recovery == "replay" and sup2.worker_args == ["--enable-deterministic-inference", PROCESSOR_FLAG]
    # a recovery the user chose stands
    router, sup3 = engine_recovery(RouterConfig(recovery="token"), sup)
    assert router.recovery == "token" and sup3.worker_args == sup.worker_args
    # replay asked for without deterministic mode: the flag is added once
    router, sup4 = engine_recovery(RouterConfig(recovery="replay"),
                                   SupervisorConfig(backend="sglang", worker_args=[PROCESSOR_FLAG]))
    assert router.recovery == "replay" and sup4.worker_args == [PROCESSOR_FLAG]


def test_replay_on_the_reference_worker_is_refused_by_name():
    with pytest.raises(ConfigError, match="replay.*SGLang"):
        engine_recovery(RouterConfig(recovery="replay"), SupervisorConfig())
    router, sup = engine_recovery(RouterConfig(), SupervisorConfig())
    assert router.recovery == "token" and sup.worker_args == []
