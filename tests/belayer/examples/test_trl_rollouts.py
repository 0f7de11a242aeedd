"""What TRL's ``rollout_func`` hands GRPOTrainer when a sandbox is beyond recovery (issue 49 item 4).

``Rollouts`` is called exactly as TRL 1.16's ``GRPOTrainer._generate`` calls its
``rollout_func`` (``rollout_func(prompts, trainer)``, one prompt per sample, a group of
``num_generations`` equal prompts; the trainer is read for ``state.global_step`` only), on
real containers and a real engine; TRL itself runs in ``test_trl_grpo.py`` (its own venv).
Episode 0's container is SIGKILLed while the model writes turn 2 and every restore of that
sandbox fails: by default the policy restarts it in a fresh sandbox and TRL gets a full group
of real rewards; with no retry left it is dropped with its group: reward ``None`` (TRL's
unscorable: advantage 0) and ``env_mask`` 0 for the whole group, never a reward of 0.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from belayer.examples.trl_grpo.episode import EpisodeConfig
from belayer.examples.trl_grpo.run import Rollouts, RunConfig
from belayer.examples.trl_grpo.tasks import TASKS
from belayer.wrappers.infra_policy import InfraPolicy
from belayer_engine import RecoverableEngine
from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
from belayer_engine.router.codec import load_codec

pytestmark = pytest.mark.timeout(600)
TRAINER = SimpleNamespace(state=SimpleNamespace(global_step=0))  # what rollout_func reads of GRPOTrainer


@pytest.fixture(scope="module")
def engine():
    with RecoverableEngine.launch(model=str(ensure_embedded_model()), workers=1, shadow=True) as eng:
        eng.wait_ready(timeout=180, stable=True)
        yield eng


def rollouts(engine, retries: int) -> tuple[Rollouts, dict]:
    cfg = RunConfig(prompts_per_step=1, group_size=2, container_kills_per_step=0, worker_kills_per_step=0,
                    beyond_recovery_per_step=1, parallel=2,
                    episode=EpisodeConfig(temperature=1.0, infra=InfraPolicy(retries=retries)))
    roll = Rollouts(cfg, engine, load_codec(str(ensure_embedded_model())), log=lambda *_: None)
    return roll, roll([TASKS[0].prompt] * 2, TRAINER)


def test_beyond_recovery_the_episode_restarts_and_trl_gets_the_whole_group(engine, docker_client):
    roll, out = rollouts(engine, retries=2)
    samples = [s for _, _, s in roll.samples]
    assert samples[0].beyond_recovery == 1 and samples[0].fresh_sandbox_retries == 1, samples[0]
    assert not any(s.failed for s in samples) and roll.dropped_with_group == 0
    assert all(isinstance(r, float) for r in out["env_reward"])  # real rewards, read from the final sandboxes
    for ids, mask, lps in zip(out["completion_ids"], out["env_mask"], out["logprobs"], strict=True):
        assert len(ids) == len(mask) == len(lps) and sum(mask) > 0


def test_past_its_retries_the_episode_is_dropped_with_its_group_never_scored_zero(engine, docker_client):
    roll, out = rollouts(engine, retries=0)
    samples = [s for _, _, s in roll.samples]
    assert samples[0].failed and "SampleDropped" in samples[0].failed, samples[0]
    assert not samples[1].failed and roll.dropped_with_group == 1
    assert out["env_reward"] == [None, None], "unscorable (advantage 0), not 0"
    assert all(set(mask) == {0} for mask in out["env_mask"]), "no loss on the group's tokens"
    assert len(out["completion_ids"][1]) == len(out["env_mask"][1])  # the peer's real tokens, masked
