"""SFT warm start and a GRPO-style update over agent episodes, in plain PyTorch.

GRPO here: for each task a group of episodes is sampled from one weight version; an
episode's advantage is its reward minus the group mean, divided by the group's std; every
generated token of the episode gets that advantage. Every episode weighs the same in the
loss (its tokens' mean): with a per-token mean, long failed episodes outweigh short
successful ones and push the policy apart (``benchmarks/grpo_loss_weighting.py``: at
rl_lr 3e-4 reward rose in 13 seeds of 13 per episode vs 11 of 13 per token; at 1e-3, 6 of
8 vs 1 of 8). A few PPO-style clipped epochs reuse the batch (ratios against the learner's
own log-probs of the sampling weights, taken from the first epoch's forward pass). Groups with no
reward spread carry no signal and are skipped. Episodes touched by unrecovered infra
failures or sampled from a stale version never enter a group.
"""

from __future__ import annotations

import random
import statistics

import torch

from .config import LearnerConfig
from .episode import Episode
from .learner_ckpt import snapshot
from .policy import PolicyModel, pack_turns, sequence_logprobs


class Learner:
    """Owns the trainable policy and its optimizer; ``step`` counts RL updates."""

    def __init__(self, cfg: LearnerConfig | None = None):
        self.cfg = cfg or LearnerConfig()
        torch.manual_seed(self.cfg.seed)
        self.model = PolicyModel(seed=self.cfg.seed)
        self.opt = self._new_optimizer()
        self.step = 0
        self.sft_done = False

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.cfg.rl_lr, weight_decay=0.0)

    def _update(self, loss: torch.Tensor, lr: float) -> float:
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.opt.step()
        return float(norm)

    def sft(self, episodes: list[Episode], steps: int | None = None, log=None) -> float:
        """Supervised warm start on expert turns; returns the last loss."""
        seqs = [s for e in episodes for s in pack_turns([(t.prompt_ids, t.completion_ids) for t in e.turns])]
        rng = random.Random(self.cfg.seed)
        loss_value = float("nan")
        for i in range(self.cfg.sft_steps if steps is None else steps):
            batch = rng.sample(seqs, min(self.cfg.sft_batch, len(seqs)))
            loss = -torch.cat(sequence_logprobs(self.model, batch)).mean()
            self._update(loss, self.cfg.sft_lr)
            loss_value = float(loss.detach())
            if log and (i % 20 == 0 or i == (steps or self.cfg.sft_steps) - 1):
                log({"event": "sft", "iter": i, "loss": round(loss_value, 4)})
        self.sft_done = True
        for state in self.opt.state.values():  # RL keeps Adam's scale (v) but not SFT's direction (m)
            state["exp_avg"].zero_()
        return loss_value

    def grpo_step(self, groups: list[list[Episode]]) -> dict:
        """One policy-gradient update from groups of episodes (one group per task)."""
        items: list[tuple[list[int], list[tuple[int, int]], float]] = []
        weights: list[float] = []  # per sequence: 1 / its episode's generated tokens
        episodes = 0
        for group in groups:
            usable = [e for e in group if e.trainable]
            if len(usable) < 2:
                continue
            rewards = [e.reward for e in usable]
            mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
            if std < 1e-6:
                continue
            for e in usable:
                adv = (e.reward - mean) / (std + 1e-4)
                packed = pack_turns([(t.prompt_ids, t.completion_ids) for t in e.turns])
                n = sum(b - a for _, spans in packed for a, b in spans)
                if n:
                    episodes += 1
                    items += [(ids, spans, adv) for ids, spans in packed]
                    weights += [1.0 / n] * len(packed)
        self.step += 1
        if not items:
            return {"tokens": 0, "loss": 0.0, "grad_norm": 0.0}
        seqs = [(ids, spans) for ids, spans, _ in items]
        advs = [adv for _, _, adv in items]
        tokens = sum(b - a for _, spans in seqs for a, b in spans)
        if self.cfg.loss_agg == "episode":
            scale = [w / episodes for w in weights]
        else:
            scale = [1.0 / tokens] * len(seqs)
        # the sampling weights' log-probs come from the first epoch's own forward pass (filled
        # in there, before its update): no separate no-grad pass over the batch
        old: list[torch.Tensor | None] | None = [None] * len(seqs) if self.cfg.epochs > 1 else None
        for _ in range(self.cfg.epochs):  # PPO-style clipped epochs over the same on-policy batch
            loss, norm = self._pg_update(seqs, advs, scale, old)
        return {"tokens": tokens, "loss": round(loss, 4), "grad_norm": round(norm, 3)}

    def _chunks(self, seqs: list) -> list[list[int]]:
        """Indices grouped by length so a chunk holds at most ``chunk_tokens`` tokens (the
        sequences go through the model packed, unpadded: ``sequence_logprobs``)."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
        chunks: list[list[int]] = [[]]
        tokens = 0
        for i in order:
            if chunks[-1] and tokens + len(seqs[i][0]) > self.cfg.chunk_tokens:
                chunks.append([])
                tokens = 0
            chunks[-1].append(i)
            tokens += len(seqs[i][0])
        return chunks

    def _pg_update(self, seqs: list, advs: list[float], scale: list[float],
                   old: list[torch.Tensor | None] | None) -> tuple[float, float]:
        """Accumulate the (clipped) policy-gradient loss chunk by chunk, then one optimizer step;
        sequence i's token terms are weighted by ``scale[i]`` (see ``loss_agg``). An empty
        ``old[i]`` is filled with this pass's detached log-probs (the first epoch: weights not
        yet updated, so its ratios are exactly 1)."""
        eps, value = self.cfg.clip, 0.0
        for group in self.opt.param_groups:
            group["lr"] = self.cfg.rl_lr
        self.opt.zero_grad(set_to_none=True)
        for chunk in self._chunks(seqs):
            lps = sequence_logprobs(self.model, [seqs[i] for i in chunk], temperature=self.cfg.temperature)
            loss = torch.zeros(())
            for i, lp in zip(chunk, lps, strict=True):
                if old is None:  # on-policy: ratio 1, plain REINFORCE with the group baseline
                    term = lp * advs[i]
                else:
                    if old[i] is None:
                        old[i] = lp.detach()
                    ratio = torch.exp(lp - old[i])
                    term = torch.minimum(ratio * advs[i], ratio.clamp(1 - eps, 1 + eps) * advs[i])
                loss = loss - term.sum() * scale[i]
            loss.backward()
            value += float(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        self.opt.step()
        return value, norm

    def snapshot(self, **extra) -> dict:
        """Everything to resume at this step boundary (see ``learner_ckpt``)."""
        return snapshot(self.model, self.opt, step=self.step, sft_done=self.sft_done,
                        torch_rng=torch.get_rng_state(), **extra)

    def restore(self, state: dict) -> dict:
        """Load a checkpoint's parameters, optimizer state and counters; return its extras."""
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        extra = dict(state["extra"])
        self.step = int(extra.pop("step"))
        self.sft_done = bool(extra.pop("sft_done"))
        torch.set_rng_state(extra.pop("torch_rng"))
        return extra
