"""``RecoverableEngine.update_weights``: one engine-wide version on every slot, and a slot
whose arena is lost comes back with the updated weights, never the checkpoint's."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from belayer_core.errors import UsageError
from belayer_engine.engine import RecoverableEngine
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import init_weights
from tests.belayer_engine.supervisor.greedy import PROMPTS, answers, assert_serves, direct

pytestmark = pytest.mark.timeout(300)


def test_updates_reach_every_slot_and_survive_an_arena_sigkill():
    w = init_weights(ModelConfig(), 5)
    with RecoverableEngine.launch(workers=2, shadow=True) as eng:
        eng.wait_ready(timeout=120)
        base = answers(eng, 0)
        assert answers(eng, 1) == base

        v1 = eng.update_weights({"model.embed_tokens.weight": w["model.embed_tokens.weight"]})
        v2 = eng.update_weights({"model.norm.weight": w["model.norm.weight"] * 2})  # partial, merged with v1
        assert v2 == v1 + 1
        updated = answers(eng, 0)
        assert updated != base, "the updates changed the greedy output"
        assert_serves(eng, (0, 1), updated, v2)

        since = time.monotonic()
        os.kill(eng.status()["slots"]["w0"]["arena_pid"], signal.SIGKILL)
        reapplied = eng.wait_event("weights_reapplied", since, timeout=120)
        assert reapplied["version"] == v2 and reapplied["names"] == 2
        eng.wait_ready(timeout=120)
        assert answers(eng, 0) == updated, "the restarted slot serves both kept updates, merged"
        assert direct(eng, 0, PROMPTS[0])[1] == v2, "and reports the engine-wide version"

        with pytest.raises(UsageError, match="unknown weight"):
            eng.update_weights({"nope": torch.zeros(2)})
        with pytest.raises(UsageError, match="non-empty mapping"):
            eng.update_weights({})
        assert answers(eng, 1) == updated, "a refused update changed nothing"
        assert eng.update_weights({"model.norm.weight": w["model.norm.weight"]}) == v2 + 1
