"""AReaL's ``RolloutWorkflow`` over Belayer: one prompt's group of multi-turn sandbox episodes.

``SandboxWorkflow(gconfig, tokenizer, episode=EpisodeConfig(...), group_size=n)`` is what an
AReaL trainer passes to ``rollout_batch``/``prepare_batch`` (AReaL 1.0.4,
``areal/api/workflow_api.py``). Each ``arun_episode(engine, data)`` runs ``group_size``
episodes of the prompt at once; each turn is ``engine.agenerate(ModelRequest(...))`` (AReaL's
own ``RemoteSGLangEngine`` against Belayer's router: a worker SIGKILLed mid-generation is
continued, AReaL sees one generation), the last fenced bash block of the reply runs as one
step of a ``RecoverableSandboxEnv``, and the observation is appended as a ChatML user turn.
The result is AReaL's padded trajectory dict (``input_ids``, ``logprobs``, ``loss_mask`` 1 on
model tokens, ``versions`` per token, -1 elsewhere, ``rewards``, ``attention_mask``), one row
per episode, as AReaL's own ``MultiTurnWorkflow`` returns.

``data`` gives ``messages`` (the prompt) and, per sample, ``setup``, ``image``,
``test_command`` (reward 1.0 when it exits 0 at submit) and ``max_turns``. Infrastructure
failures follow ``belayer.wrappers.infra_policy``: a rollback cuts the episode's tokens back
to the restored boundary and the model regenerates; a fresh sandbox is a rollback to 0; a
sample dropped past the retries makes ``arun_episode`` return ``None`` for the whole group,
AReaL's "rejected, not used for training" (never a zero reward), counted in AReaL's
``stats_tracker`` as ``belayer/dropped_groups``. AReaL lives in its own venv
(``scripts/setup_areal.sh``); this module imports it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import torch
from areal import workflow_context
from areal.api import InferenceEngine, ModelRequest, RolloutWorkflow
from areal.api.cli_args import GenerationHyperparameters
from areal.utils import stats_tracker
from areal.utils.data import concat_padded_tensors
from areal.utils.hf_utils import apply_chat_template

from belayer.wrappers.chat_history import parse_bash_block
from belayer.wrappers.episode import (
    EpisodeConfig,
    TokenRecord,
    episode_env,
    observation_ids,
    reset_options,
)
from belayer.wrappers.infra_policy import SampleDropped


class SandboxWorkflow(RolloutWorkflow):
    def __init__(self, gconfig: GenerationHyperparameters, tokenizer: Any,
                 episode: EpisodeConfig | dict[str, Any] | None = None, group_size: int = 1):
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.tokenizer = tokenizer
        self.episode = episode if isinstance(episode, EpisodeConfig) else EpisodeConfig(**(episode or {}))
        self.group_size = group_size
        self._im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
        self._newline = tokenizer.encode("\n", add_special_tokens=False)
        self.labels: list[dict[str, Any]] = []  # every episode's Belayer label, in order (for callers and tests)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        results = await asyncio.gather(*(self._one(engine, data) for _ in range(self.group_size)),
                                       return_exceptions=True)
        scope = stats_tracker.get(workflow_context.stat_scope())
        failed = [r for r in results if isinstance(r, BaseException)]
        if any(not isinstance(r, SampleDropped) for r in failed):
            raise next(r for r in failed if not isinstance(r, SampleDropped))
        if failed:  # the whole group is rejected: its baseline would be biased without the dropped sample
            scope.scalar(**{"belayer/dropped_groups": 1.0, "belayer/dropped_samples": float(len(failed))})
            return None
        scope.scalar(**{"belayer/dropped_groups": 0.0})
        return concat_padded_tensors(list(results))

    async def _one(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        meta = {k: v for k, v in data.items() if k != "messages"}
        env = episode_env(self.episode, meta)
        prompt = list(apply_chat_template(self.tokenizer, data["messages"], tokenize=True, add_generation_prompt=True))
        rec = TokenRecord(seq=list(prompt), logprobs=[0.0] * len(prompt), mask=[0] * len(prompt),
                          versions=[-1] * len(prompt))
        label: dict[str, Any] = {"rollbacks": []}
        self.labels.append(label)
        reward = 0.0
        try:
            await asyncio.to_thread(env.reset, options=reset_options(meta))
            cap = min(self.gconfig.max_new_tokens, self.episode.max_tokens_per_turn or self.gconfig.max_new_tokens)
            while True:
                req = ModelRequest(rid=uuid.uuid4().hex, input_ids=list(rec.seq),
                                   gconfig=self.gconfig.new(n_samples=1, max_new_tokens=cap), tokenizer=self.tokenizer)
                resp = await engine.agenerate(req)
                rec.seq.extend(resp.output_tokens)
                rec.logprobs.extend(resp.output_logprobs)
                rec.mask.extend([1] * resp.output_len)
                rec.versions.extend(resp.output_versions)
                reply = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
                obs, step_reward, terminated, truncated, info = await asyncio.to_thread(
                    env.step, parse_bash_block(reply).replace("\x00", ""))
                rollback = info["belayer"].get("rollback")
                if rollback is not None:  # the sandbox is at boundary j: so is the episode
                    label["rollbacks"].append({**rollback, "tokens_cut": rec.cut(rollback["to_step"], count="mask")})
                    continue
                if terminated or truncated:
                    reward = float(step_reward)
                    break
                user = apply_chat_template(self.tokenizer, [{"role": "user", "content": obs}], tokenize=True,
                                           add_generation_prompt=True)
                ids = observation_ids(rec.seq, self._im_end, self._newline, list(user))
                rec.seq.extend(ids)
                rec.logprobs.extend([0.0] * len(ids))
                rec.mask.extend([0] * len(ids))
                rec.versions.extend([-1] * len(ids))
                rec.commit(info["belayer"]["step"])
        except SampleDropped as e:
            label["dropped"] = [a["error"] for a in e.attempts]
            raise
        finally:
            trajectory = env.unwrapped.trajectory
            label.update(turns=len(trajectory.steps), recovered=trajectory.recovered, **env.label())
            await asyncio.to_thread(env.close)
        res = {"input_ids": torch.tensor(rec.seq, dtype=torch.int32),
               "logprobs": torch.tensor(rec.logprobs, dtype=torch.float32),
               "loss_mask": torch.tensor(rec.mask, dtype=torch.int32),
               "versions": torch.tensor(rec.versions, dtype=torch.int32),
               "rewards": torch.tensor(reward, dtype=torch.float32),
               "attention_mask": torch.ones(len(rec.seq), dtype=torch.bool)}
        return {k: v.unsqueeze(0) for k, v in res.items()}
