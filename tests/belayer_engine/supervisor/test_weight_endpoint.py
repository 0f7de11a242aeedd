"""The engine's weight endpoint (``RecoverableEngine.weights_socket``): a learner in another
process updates every slot under one engine-wide version, the engine keeps the update, and a
slot whose arena is SIGKILLed comes back serving it. Bad input is refused with a clear 4xx
and changes nothing."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from belayer_core.errors import StaleWeightVersion, UsageError
from belayer_engine.arena.client import ArenaClient
from belayer_engine.engine import RecoverableEngine
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import init_weights
from belayer_engine.weights.client import EngineWeights
from belayer_engine.weights.wire import ROUTE
from tests.belayer_engine.supervisor.greedy import PROMPTS, answers, assert_serves, direct

pytestmark = pytest.mark.timeout(300)

PUSHER = Path(__file__).with_name("weights_pusher.py")


def test_out_of_process_update_survives_an_arena_sigkill():
    with RecoverableEngine.launch(workers=2, shadow=True) as eng:
        eng.wait_ready(timeout=120)
        sock = Path(eng.weights_socket)
        assert sock.parent == eng.supervisor.run_dir and stat.S_IMODE(sock.stat().st_mode) == 0o600
        base = answers(eng, 0)

        out = subprocess.run([sys.executable, str(PUSHER), str(sock), "5"], capture_output=True, text=True,
                             timeout=180, env={**os.environ})
        assert out.returncode == 0, out.stderr[-3000:]
        pushed = json.loads(out.stdout.strip().splitlines()[-1])
        v2 = pushed["v2"]
        assert v2 == pushed["v1"] + 5 == pushed["engine_version"]
        updated = answers(eng, 1)
        assert updated != base, "the learner's updates changed the greedy output"
        assert_serves(eng, (0, 1), updated, v2)

        since, killed = time.monotonic(), eng.status()["slots"]["w0"]["arena_pid"]
        os.kill(killed, signal.SIGKILL)
        reapplied = eng.wait_event("weights_reapplied", since, timeout=120)
        assert reapplied["version"] == v2 and reapplied["names"] == 2
        eng.wait_ready(timeout=120)
        assert eng.status()["slots"]["w0"]["arena_pid"] != killed, "a new arena serves slot 0"
        assert answers(eng, 0) == updated, "the cold-restarted slot serves the learner's weights, merged"
        assert direct(eng, 0, PROMPTS[0])[1] == v2, "and reports the engine-wide version"
        assert ArenaClient(eng.arena_socket(0)).describe()["version"] == v2


def _post(sock: str, body: bytes, query: str = "") -> tuple[int, dict]:
    """A raw POST of ``body`` to the endpoint (what a non-Python learner or curl sends)."""
    conn = http.client.HTTPConnection("engine", timeout=60)
    conn.sock = socket.socket(socket.AF_UNIX)
    conn.sock.connect(sock)
    try:
        conn.request("POST", ROUTE + query, body=body)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_bad_input_is_refused_and_changes_nothing():
    from safetensors.torch import save

    w = init_weights(ModelConfig(), 7)
    norm = w["model.norm.weight"]
    with RecoverableEngine.launch(workers=1, shadow=False) as eng:
        eng.wait_ready(timeout=120)
        client = EngineWeights(eng.weights_socket, timeout=120)
        base = answers(eng, 0)
        # a plain safetensors file is a valid body
        status, reply = _post(eng.weights_socket, save({"model.norm.weight": norm * 3}))
        assert (status, reply["version"]) == (200, 1)
        served = answers(eng, 0)
        assert served != base

        refused = [
            ({"nope": torch.zeros(2)}, "unknown weight 'nope'"),
            ({"model.norm.weight": torch.zeros(3)}, r"model.norm.weight: shape \[3\] != \[256\]"),
            ({"model.norm.weight": norm.double()}, "dtype 'F64', the served weights are float32"),
            # refused from the header, before the large tensor after it is read
            ({"model.embed_tokens.weight": w["model.embed_tokens.weight"], "nope": torch.zeros(1 << 20)},
             "unknown weight 'nope'"),
        ]
        for state_dict, message in refused:
            with pytest.raises(UsageError, match=message) as exc:
                client.update_weights(state_dict)
            assert "HTTP 400" in str(exc.value)
        with pytest.raises(StaleWeightVersion, match="version 1 is not newer than the current 1.*HTTP 409"):
            client.update_weights({"model.norm.weight": norm}, version=1)

        good = save({"model.norm.weight": norm})
        raw = [
            (b"\x00" * 3, "", "too short"),
            (b"\x04\x00\x00\x00\x00\x00\x00\x00nope", "", "not JSON"),
            (good[:-8], "", "too short"),
            (good + b"x", "", "after its last tensor"),
            (good, "?version=x", "version must be an int"),
            (good, "?versoin=9", "unknown query parameter"),
        ]
        for body, query, message in raw:
            status, reply = _post(eng.weights_socket, body, query)
            assert status == 400 and message in reply["error"]["message"], (message, status, reply)
            assert reply["error"]["type"] == "UsageError"

        assert client.version() == 1, "no refused update changed the engine's version"
        assert answers(eng, 0) == served and direct(eng, 0, PROMPTS[0])[1] == 1, "nor the served weights"
        assert not [e for e in eng.events() if e["event"] == "weights_updated" and e["version"] != 1]

        # a push straight to the arena still works, is not kept, and the engine says so
        assert ArenaClient(eng.arena_socket(0)).update_weights({"model.norm.weight": norm}) == 2
        assert client.update_weights({"model.norm.weight": norm * 3}) == 3
        unmanaged = [e for e in eng.events() if e["event"] == "weights_unmanaged"]
        assert [(e["arena_version"], e["engine_version"]) for e in unmanaged] == [(2, 1)]
        assert answers(eng, 0) == served
