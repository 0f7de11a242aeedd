"""A short supervised warm start, so the GRPO groups have rewards to rank.

The embedded model's weights are random: every episode would score 0 and every GRPO
advantage would be 0. A few full-batch steps of cross-entropy on the expert's turns
(``echo WORD > notes.txt``, then ``cat notes.txt``, with the observations between them
as the env would render them, not trained) stop well before the policy is good, as the
SWE demo's warm start does (``examples/swe_rl/learner.py``). Plain torch on the same
transformers model TRL then trains. The embedded model's output layer is scaled up 8x
(``LM_HEAD_SCALE``: greedy ties far apart, for the engine's exactness tests); the warm
start first scales it back, which makes its first steps count (loss ~8 instead of ~50).
The ``environment_factory`` run trains on the same turns as TRL renders them (``expert_ids``:
the tool schema, ``<tool_call>`` JSON, tool responses), ~1,260 byte tokens a task: the random
model writes a valid call after ~100 steps on one task (loss 8.7 -> 0.001).
"""

from __future__ import annotations

import json

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


def expert_conversation(task: Task) -> list[dict]:
    """The expert's two ``bash`` calls and the answer after them, with the tool responses between."""
    outputs = ["", task.word + "\n"]
    messages = [{"role": "user", "content": task.prompt}]
    for command, output in zip(task.expert, outputs, strict=True):
        call = {"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "bash", "content": OBSERVATION_TEMPLATE.format(returncode=0, output=output)}]
    return messages + [{"role": "assistant", "content": "done"}]


def expert_ids(tokenizer, task: Task, tools: list, chat_template: str) -> tuple[list[int], list[int]]:
    """(ids, mask) of the rendered expert conversation; mask 1 on the assistant turns' tokens."""
    messages = expert_conversation(task)

    def render(msgs, gen):
        return list(tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True, add_generation_prompt=gen,
                                                  chat_template=chat_template, return_dict=False))
    ids = render(messages[:1], True)
    mask = [0] * len(ids)
    for k in range(1, len(messages)):
        full = render(messages[: k + 1], messages[k]["role"] == "tool")
        new = full[len(ids):]
        if full[: len(ids)] != ids:
            raise ValueError(f"the chat template is not prefix-preserving at message {k}: {json.dumps(messages[k])}")
        mask += [int(messages[k]["role"] == "assistant")] * len(new)
        ids = full
    return ids, mask


def warm_start(model, seqs: list[tuple[list[int], list[int]]], steps: int, lr: float, pad_id: int) -> list[float]:
    """``steps`` AdamW steps on every (ids, mask) expert sequence at once (``expert_sequence``
    for the rollout_func run, ``expert_ids`` for the tool-call one); returns the losses."""
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
