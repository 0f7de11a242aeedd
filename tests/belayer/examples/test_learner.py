"""The GRPO loss: every episode weighs the same, whatever its length."""

from __future__ import annotations

import pytest
import torch

from belayer.examples.swe_rl.config import LearnerConfig
from belayer.examples.swe_rl.episode import Episode, Turn
from belayer.examples.swe_rl.learner import Learner
from belayer.examples.swe_rl.policy import sequence_logprobs


def _episode(task: str, prompt_len: int, completion_len: int, reward: float) -> Episode:
    prompt = [(7 * i + len(task)) % 250 for i in range(prompt_len)]
    completion = [(11 * i + 3) % 250 for i in range(completion_len)]
    return Episode(task_id=task, reward=reward, turns=[Turn(prompt_ids=prompt, completion_ids=completion,
                                                            weight_version=1)])


@pytest.mark.parametrize("loss_agg", ["episode", "token"])
def test_loss_is_the_episode_or_token_mean(loss_agg):
    learner = Learner(LearnerConfig(epochs=1, loss_agg=loss_agg, rl_lr=0.0))
    # a short success and a long failure in one group: advantages +1 and -1
    group = [_episode("t", 12, 4, 1.0), _episode("t", 12, 40, 0.0)]
    seqs = [(e.turns[0].prompt_ids + e.turns[0].completion_ids, [(12, 12 + len(e.turns[0].completion_ids))])
            for e in group]
    with torch.no_grad():
        lps = sequence_logprobs(learner.model, seqs)
    adv = [0.5 / (0.5 + 1e-4), -0.5 / (0.5 + 1e-4)]  # (r - mean) / (std + eps)
    if loss_agg == "episode":
        want = -sum(a * lp.mean() for a, lp in zip(adv, lps, strict=True)) / 2
    else:
        want = -sum(a * lp.sum() for a, lp in zip(adv, lps, strict=True)) / (4 + 40)
    metrics = learner.grpo_step([group])
    assert metrics["tokens"] == 44
    assert metrics["loss"] == pytest.approx(float(want), abs=1e-3)


def test_groups_without_reward_spread_carry_no_signal():
    learner = Learner(LearnerConfig(epochs=1))
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    metrics = learner.grpo_step([[_episode("a", 8, 4, 1.0), _episode("a", 8, 6, 1.0)]])
    assert metrics["tokens"] == 0
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())


def test_packed_logprobs_match_the_padded_forward():
    """``sequence_logprobs`` packs sequences unpadded (``forward_packed``): the same
    log-probs and gradients as each sequence scored by the padded batched ``forward``."""
    from belayer.examples.swe_rl.policy import PolicyModel

    model = PolicyModel(seed=0)
    seqs = [([(5 * i + k) % 500 for i in range(n)], [(n - 6, n - 2), (n - 1, n)] if k % 2 else [(3, n)])
            for k, n in enumerate([9, 40, 17, 33])]
    packed = sequence_logprobs(model, seqs, temperature=0.7)
    batch = torch.zeros(len(seqs), 40, dtype=torch.long)
    for i, (ids, _) in enumerate(seqs):
        batch[i, : len(ids)] = torch.tensor(ids)
    logp = torch.log_softmax(model(batch) / 0.7, dim=-1)
    padded = [logp[i, [p for a, b in spans for p in range(a - 1, b - 1)], [ids[p] for a, b in spans for p in range(a, b)]]
              for i, (ids, spans) in enumerate(seqs)]
    weights = [0.3, -1.0, 0.7, 2.0]
    grads = []
    for lps in (packed, padded):
        assert [len(x) for x in lps] == [sum(b - a for a, b in spans) for _, spans in seqs]
        model.zero_grad()
        sum(w * x.sum() for w, x in zip(weights, lps, strict=True)).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for x, y in zip(packed, padded, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-5, rtol=1e-3)
