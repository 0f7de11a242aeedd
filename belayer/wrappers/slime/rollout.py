"""``generate(args, sample, sampling_params)``: slime's custom generate function, one
multi-turn episode of bash actions in a ``RecoverableSandboxEnv``::

    --custom-generate-function-path belayer.wrappers.slime.generate
    --rollout-external-engine-addrs HOST:PORT     # Belayer's engine (its router)

It reads and writes what slime's own ``generate`` (slime/rollout/sglang_rollout.py) and
its multi-turn example (examples/search-r1/generate_with_search.py) do:

- each turn posts SGLang's native ``/generate`` to ``http://{args.sglang_router_ip}:
  {args.sglang_router_port}/generate``: ``input_ids`` (prompt + response so far), slime's
  ``sampling_params`` (``max_new_tokens`` lowered to what is left of the response budget)
  and ``return_logprob: True``; it reads ``text``, ``meta_info.output_token_logprobs``
  ((logprob, token_id, text) triples), ``meta_info.finish_reason.type`` and
  ``meta_info.weight_version``. A worker SIGKILLed mid-generation is continued by the
  engine: the answer is one generation. A turn cut by ``max_tokens_per_turn`` still runs.
- the model's tokens enter the sample with their logprobs and loss mask 1; the command's
  observation (a ChatML user turn, its content encoded as plain text) with mask 0 and
  logprob 0.0.
- on ``info["belayer"]["rollback"]`` (the env restored boundary j after an infrastructure
  failure; boundary 0 of a fresh sandbox when its recovery was exhausted:
  ``belayer.wrappers.infra_policy``) the sample's tokens, mask, logprobs, text and weight
  versions are cut back to boundary j and the model regenerates from there; nothing is
  replayed.
- it ends COMPLETED at submit (``sample.reward`` = the env's reward: ``test_command`` exits
  0), TRUNCATED when the token budget or ``max_turns`` runs out (reward 0.0: the episode's
  outcome), ABORTED when the engine answers ``finish_reason: abort`` (slime aborting its own
  requests; reward left to slime, as its own ``generate`` does), and ABORTED with
  ``remove_sample`` and no reward (``None``) when the policy drops it (recovery and its
  fresh-sandbox retries failed), labelled ``metadata["belayer"]["dropped"]``. With
  ``--dynamic-sampling-filter-path belayer.wrappers.slime.keep_group`` its whole prompt group
  is dropped, counted and replaced by slime's over-sampling.

Per sample, ``sample.metadata`` (slime's ``--metadata-key`` column) may give ``task``,
``setup``, ``image``, ``test_command`` and ``max_turns``; ``args.belayer_episode`` (an
``EpisodeConfig`` or a dict of its fields) the rest. Text <-> ids go through the router's
codec (``load_codec(args.hf_checkpoint)``: the checkpoint's ``tokenizer.json``, or the
embedded model for ``None``). Partial rollout is not supported (the sandbox does not
outlive the call).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from belayer.wrappers.episode import (
    EpisodeConfig,
    TokenRecord,
    episode_env,
    observation_ids,
    post_json,
    reset_options,
)
from belayer.wrappers.infra_policy import SampleDropped
from belayer_core.errors import UsageError

__all__ = ["EpisodeConfig", "generate", "keep_group", "run_episode"]
DROPPED_REASON = "belayer_infra_dropped"


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """slime's ``--custom-generate-function-path`` entry: ``run_episode`` with
    ``args.belayer_episode`` (default ``EpisodeConfig()``)."""
    config = getattr(args, "belayer_episode", None) or EpisodeConfig()
    if isinstance(config, dict):
        config = EpisodeConfig(**config)
    return await run_episode(args, sample, sampling_params, config)


async def run_episode(args: Any, sample: Any, sampling_params: dict[str, Any], config: EpisodeConfig) -> Any:
    from belayer.wrappers.chat_history import parse_bash_block

    if getattr(args, "partial_rollout", False):
        raise UsageError("belayer.wrappers.slime.generate does not support --partial-rollout")
    status = type(sample).Status  # slime's Sample.Status, without importing slime
    if sample.status not in (status.PENDING, status.ABORTED):  # as slime's generate asserts
        raise UsageError(f"sample status is {sample.status}")
    meta = dict(sample.metadata or {})
    codec = _codec(getattr(args, "hf_checkpoint", None))
    prompt_ids = codec.render_chat(sample.prompt) if isinstance(sample.prompt, list) else codec.encode(sample.prompt)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    budget = int(sampling_params["max_new_tokens"])
    env = episode_env(config, meta)
    out = _Response()
    label: dict[str, Any] = {"rollbacks": [], "worker_recoveries": 0}
    end, reward = status.TRUNCATED, 0.0
    try:
        await asyncio.to_thread(env.reset, options=reset_options(meta))
        while (left := budget - len(out.ids)) > 0:
            turn_cap = min(left, config.max_tokens_per_turn or left)
            payload = {"input_ids": prompt_ids + out.ids, "return_logprob": True,
                       "sampling_params": {**sampling_params, "max_new_tokens": turn_cap}}
            output = await _post(url, payload)
            info = output["meta_info"]
            finish = info["finish_reason"]["type"]
            label["worker_recoveries"] += int((info.get("belayer") or {}).get("recoveries", 0))  # Belayer's engine only
            if finish == "abort":  # slime aborts its requests (end of rollout, weight update)
                end, reward = status.ABORTED, None
                out.cut(out.boundary)
                break
            out.model(info["output_token_logprobs"], output["text"], info.get("weight_version"))
            if finish == "length" and turn_cap == left:  # the response budget is spent
                break
            command = parse_bash_block(output["text"]).replace("\x00", "")  # NUL cannot reach bash
            obs, step_reward, terminated, truncated, step_info = await asyncio.to_thread(env.step, command)
            rollback = step_info["belayer"].get("rollback")
            if rollback is not None:  # the sandbox is at boundary j (0 in a fresh one): so is the sample
                label["rollbacks"].append({**rollback, "tokens_cut": out.cut(rollback["to_step"])})
                continue
            if terminated or truncated:
                end, reward = (status.COMPLETED if terminated else status.TRUNCATED), float(step_reward)
                break
            out.observation(codec, obs)
            out.commit(step_info["belayer"]["step"])
    except SampleDropped as e:  # recovery and the fresh-sandbox retries failed: no sample, no reward
        out.cut(out.boundary)
        end, reward = status.ABORTED, None
        sample.remove_sample = True
        label["dropped"] = [a["error"] for a in e.attempts]
    finally:
        await asyncio.to_thread(env.close)
    trajectory = env.unwrapped.trajectory
    label.update(turns=len(trajectory.steps), recovered=trajectory.recovered, **env.label())
    _write(sample, prompt_ids, out, end, reward, {**meta, "belayer": label})
    return sample


def keep_group(args: Any, samples: list, **kwargs: Any) -> Any:
    """slime's ``--dynamic-sampling-filter-path belayer.wrappers.slime.keep_group``: a prompt group
    holding a dropped sample is dropped whole (slime then samples another prompt, and counts the
    drop by reason, ``belayer_infra_dropped``, in its rollout metrics). To combine it with
    another filter, call that one when this one keeps the group."""
    flat = [s for item in samples for s in (item if isinstance(item, list) else [item])]
    keep = not any("dropped" in ((s.metadata or {}).get("belayer") or {}) for s in flat)
    try:
        from slime.rollout.filter_hub.base_types import DynamicFilterOutput
    except ImportError:
        return keep
    return DynamicFilterOutput(keep=keep, reason=None if keep else DROPPED_REASON)


class _Response(TokenRecord):
    """The sample's response side (ids, loss mask, logprobs, text pieces, weight versions),
    cut back with the env's boundaries."""

    def __init__(self) -> None:
        super().__init__(ids=[], mask=[], logprobs=[], text=[], versions=[])

    def model(self, triples: list, text: str, version: str | None) -> None:
        self.ids.extend(int(t[1]) for t in triples)
        self.logprobs.extend(float(t[0]) for t in triples)
        self.mask.extend([1] * len(triples))
        self.text.append(text)
        if version is not None:
            self.versions.append(version)

    def observation(self, codec: Any, observation: str) -> None:
        ids = observation_ids(self.ids, codec.encode("<|im_end|>"), codec.encode("\n"),
                              codec.render_chat([{"role": "user", "content": observation}]))
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.text.append(codec.decode_output(ids, skip_special_tokens=False))


def _write(sample: Any, prompt_ids: list[int], out: _Response, status: Any, reward: float | None,
           metadata: dict[str, Any]) -> None:
    """The fields slime reads from a generated sample (as examples/search-r1 sets them)."""
    sample.tokens = prompt_ids + out.ids
    sample.response_length = len(out.ids)
    sample.response = "".join(out.text)
    sample.loss_mask = out.mask
    sample.rollout_log_probs = out.logprobs
    sample.weight_versions = out.versions
    sample.status = status
    if reward is not None:
        sample.reward = reward
    sample.metadata = metadata


@functools.lru_cache(maxsize=4)
def _codec(model_dir: str | None) -> Any:
    from belayer_engine.router.codec import load_codec

    return load_codec(model_dir)


async def _post(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    """slime's own client where slime is installed (its connection limits and retries), else one
    JSON POST."""
    try:
        from slime.utils.http_utils import post
    except ImportError:
        return await post_json(url, payload)
    return await post(url, payload)
