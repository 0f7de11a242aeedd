"""A short supervised warm start, so the GRPO groups have rewards to rank.

The embedded model's weights are random: every episode would score 0 and every GRPO
advantage would be 0. A few full-batch steps of cross-entropy on the expert's turns
(``echo WORD > notes.txt``, then ``cat notes.txt``, with the observations between them
as the env would render them, not trained) stop well before the policy is good, as the
SWE demo's warm start does (``examples/swe_rl/learner.py``). Plain torch on the same
transformers model TRL then trains. The embedded model's output layer is scaled up 8x
(``LM_HEAD_SCALE``: greedy ties far apart, for the engine's exactness tests); the warm
start first scales it back, which makes its first steps count (loss ~8 instead of ~50).
"""

from __future__ import annotations

import torch

from belayer_engine.backends.sglang.model_dir import LM_HEAD_SCALE
from belayer_env.env.config import OBSERVATION_TEMPLATE

from .episode import observation_ids
from .tasks import Task


def expert_sequence(task: Task, codec) -> tuple[list[int], list[int]]:
    """(ids, mask): the prompt and the expert's two turns; mask 1 on the expert's tokens."""
    im_end = codec.encode("<|im_end|>")[0]
    ids = codec.render_chat([{"role": "user", "content": task.prompt}])
    mask = [0] * len(ids)
    outputs = ["", task.word + "\n"]
    for k, command in enumerate(task.expert):
        turn = codec.encode(command) + [im_end]
        ids, mask = ids + turn, mask + [1] * len(turn)
        if k < len(task.expert) - 1:
            obs = observation_ids(codec, turn, OBSERVATION_TEMPLATE.format(returncode=0, output=outputs[k]), im_end)
            ids, mask = ids + obs, mask + [0] * len(obs)
    return ids, mask


def warm_start(model, codec, tasks: list[Task], steps: int, lr: float, pad_id: int) -> list[float]:
    """``steps`` AdamW steps on every task's expert sequence at once; returns the losses."""
    seqs = [expert_sequence(t, codec) for t in tasks]
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, m) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
        labels[i, : len(s)] = torch.tensor([t if keep else -100 for t, keep in zip(s, m, strict=True)])
    with torch.no_grad():
        model.lm_head.weight.div_(LM_HEAD_SCALE)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(float(loss.detach()), 4))
    return losses
