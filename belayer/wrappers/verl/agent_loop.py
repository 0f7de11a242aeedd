"""``BelayerSandboxAgentLoop``: a verl agent loop (``@register("belayer_sandbox")``) whose
sample is one multi-turn episode of bash actions in a ``RecoverableSandboxEnv``.

Per turn it asks ``server_manager.generate`` (verl's ``LLMServerClient``, or Belayer's
``EngineClient``) for the model's tokens, runs the last fenced bash block of the reply as one
env step, and appends the observation as a user message, with verl's own Continuous Token
builder (``ct_build_initial_tokens``, ``ct_merge_assistant_token``, ``ct_merge_context_msg``,
as verl's ``ToolAgentLoop`` does): model tokens carry loss mask 1 and the engine's logprobs,
observation tokens 0. The dataset row gives the prompt (``raw_prompt``) and, in
``extra_info``, ``setup``, ``image``, ``test_command`` (the reward: 1.0 when it exits 0 at
submit) and ``max_turns``. The agent-loop kwarg ``belayer`` (``agent_loops.yaml``) holds
``EpisodeConfig`` fields.

Infrastructure failures follow ``belayer.wrappers.infra_policy``: a rollback to boundary j
cuts the sample's tokens, mask, logprobs and messages back to j and the model regenerates
from there; a fresh sandbox (recovery exhausted) is a rollback to 0; past the policy's
retries the loop raises ``SampleDropped``: verl's TransferQueue trainer (``trainer.v1``)
marks the prompt's group failed and evicts it (``rollout_failure/evicted_samples``; refilled
with ``trainer.v1.sampler.sync_refill_failed_groups``), never a zero reward. Labels go to
``extra_fields["belayer"]``; ``min_global_steps``/``max_global_steps`` are the weight
versions of the sample's surviving turns.
"""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from belayer.wrappers.chat_history import parse_bash_block
from belayer.wrappers.episode import EpisodeConfig, TokenRecord, episode_env, reset_options
from belayer.wrappers.verl import AGENT_NAME


@register(AGENT_NAME)
class BelayerSandboxAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, belayer: dict[str, Any] | EpisodeConfig | None = None, **kwargs: Any):
        kwargs.pop("tools", None)  # verl's tool list (ToolAgentLoop's); the sandbox is this loop's tool
        kwargs.pop("name", None)  # the registry entry's own name, when it comes from agent_loops.yaml
        super().__init__(*args, **kwargs)
        if belayer is not None and not isinstance(belayer, EpisodeConfig):
            belayer = EpisodeConfig(**_plain(belayer))
        self.episode = belayer or EpisodeConfig()
        self.response_length = self.rollout_config.response_length

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        meta = _plain(kwargs.get("extra_info") or {})
        env = episode_env(self.episode, meta)
        prompt_ids = await self.ct_build_initial_tokens(messages)
        rec = TokenRecord(ids=list(prompt_ids), mask=[], logprobs=[], messages=messages, versions=[])
        label: dict[str, Any] = {"rollbacks": [], "worker_recoveries": 0}
        reward, generate_s = 0.0, 0.0
        try:
            await asyncio.to_thread(env.reset, options=reset_options(meta))
            while (left := self.response_length - len(rec.mask)) > 0:
                cap = min(left, self.episode.max_tokens_per_turn or left)
                t0 = self.loop.time()
                output = await self.server_manager.generate(
                    request_id=uuid4().hex, prompt_ids=list(rec.ids),
                    sampling_params={**sampling_params, "max_tokens": cap})
                generate_s += self.loop.time() - t0
                label["worker_recoveries"] += int(output.extra_fields.get("belayer", {}).get("recoveries", 0))
                await self._model_turn(rec, output)
                if output.stop_reason == "length" and cap == left:  # the response budget is spent
                    break
                reply = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
                command = parse_bash_block(reply).replace("\x00", "")  # NUL cannot reach bash
                obs, step_reward, terminated, truncated, info = await asyncio.to_thread(env.step, command)
                rollback = info["belayer"].get("rollback")
                if rollback is not None:  # the sandbox is at boundary j: so is the sample
                    j = rollback["to_step"]
                    label["rollbacks"].append({**rollback, "tokens_cut": rec.cut(j, count="mask")})
                    continue
                if terminated or truncated:
                    reward = float(step_reward)
                    break
                await self._observation(rec, reply, obs)
                rec.commit(info["belayer"]["step"])
        finally:
            trajectory = env.unwrapped.trajectory
            label.update(turns=len(trajectory.steps), recovered=trajectory.recovered, **env.label())
            await asyncio.to_thread(env.close)
        response = rec.ids[len(prompt_ids):]
        versions = rec.versions or [None]
        return AgentLoopOutput(
            prompt_ids=list(prompt_ids), response_ids=response[: self.response_length],
            response_mask=rec.mask[: self.response_length], response_logprobs=rec.logprobs[: self.response_length],
            reward_score=reward, num_turns=len(rec.messages),
            metrics=AgentLoopMetrics(generate_sequences=generate_s),
            extra_fields={"belayer": label, "weight_versions": sorted(set(versions), key=str),
                          "min_global_steps": min(versions, key=_order), "max_global_steps": max(versions, key=_order)})

    async def _model_turn(self, rec: TokenRecord, output: Any) -> None:
        merged, mask, logprobs = await self.ct_merge_assistant_token(
            rec.ids, output.token_ids, rec.mask, rec.logprobs, assistant_logprobs=output.log_probs)
        rec.ids[:] = merged.token_ids
        rec.mask[:] = mask
        rec.logprobs[:] = logprobs or []
        rec.versions.extend(output.extra_fields.get("weight_versions") or [output.extra_fields.get("global_steps")])

    async def _observation(self, rec: TokenRecord, reply: str, observation: str) -> None:
        rec.messages.append({"role": "assistant", "content": reply})  # its tokens are in already
        previous = list(rec.messages)
        rec.messages.append({"role": "user", "content": observation})
        merged, mask, logprobs = await self.ct_merge_context_msg(previous, rec.messages, rec.ids, rec.mask,
                                                                 rec.logprobs)
        rec.ids[:] = merged.token_ids
        rec.mask[:] = mask
        rec.logprobs[:] = logprobs or []


def _order(version: Any) -> tuple:
    return (0, version) if isinstance(version, int) else (1, str(version))


def _plain(value: Any) -> dict[str, Any]:
    """A dict from verl's row field or hydra config (numpy 0-d object, ``DictConfig``, mapping)."""
    if hasattr(value, "item") and not isinstance(value, dict):
        value = value.item()
    if type(value).__name__ == "DictConfig":
        from omegaconf import OmegaConf

        value = OmegaConf.to_container(value, resolve=True)
    return dict(value)
