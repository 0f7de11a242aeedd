"""The example's learner pushes through the engine's weight endpoint, so its weights survive
a cold restart of the worker's arena (a push to one arena would be forgotten there)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from belayer_engine.engine import RecoverableEngine
from tests.belayer_engine.supervisor.greedy import PROMPTS, answers, direct

# The learner process's push, as trainer.train does it: its full hf_state_dict after an update.
LEARNER = """
import sys, torch
from belayer.examples.swe_rl.learner import Learner
from belayer_engine.weights.client import EngineWeights
learner = Learner()
with torch.no_grad():  # stands in for a GRPO step: the pushed weights differ from the arena's
    emb = learner.model.w("model.embed_tokens.weight")
    emb.add_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(3)) * emb.std())
print(EngineWeights(sys.argv[1]).update_weights(learner.model.hf_state_dict()))
"""


@pytest.mark.timeout(300)
def test_learner_weights_survive_a_worker_arena_cold_restart():
    with RecoverableEngine.launch(workers=1, shadow=True) as eng:
        eng.wait_ready(timeout=120)
        base = answers(eng, 0)
        out = subprocess.run([sys.executable, "-c", LEARNER, eng.weights_socket], capture_output=True,
                             text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        version = int(out.stdout.strip().splitlines()[-1])
        trained = answers(eng, 0)
        assert trained != base and direct(eng, 0, PROMPTS[0])[1] == version

        since, killed = time.monotonic(), eng.status()["slots"]["w0"]["arena_pid"]
        os.kill(killed, signal.SIGKILL)
        assert eng.wait_event("weights_reapplied", since, timeout=120)["version"] == version
        eng.wait_ready(timeout=120)
        assert eng.status()["slots"]["w0"]["arena_pid"] != killed
        assert answers(eng, 0) == trained, "the restarted arena serves the learner's weights"
        assert direct(eng, 0, PROMPTS[0])[1] == version
