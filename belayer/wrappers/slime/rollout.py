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
  failure) the sample's tokens, mask, logprobs, text and weight versions are cut back to
  boundary j and the model regenerates from there; nothing is replayed.
- it ends COMPLETED at submit (``sample.reward`` = the env's reward: ``test_command`` exits
  0), TRUNCATED when the token budget or ``max_turns`` runs out (reward 0.0), ABORTED when
  the engine answers ``finish_reason: abort`` (slime aborting its own requests; reward left
  to slime, as its own ``generate`` does), and ABORTED with ``remove_sample`` (slime then
  zeroes the loss mask; reward 0.0 as slime's coding-agent example sets) only when the env's
  recovery is exhausted, labelled ``metadata["belayer"]["failed"]``.

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
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from belayer_core.errors import InfraError, RequestFailed, UsageError


class EpisodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(16, ge=1)
    """Committed env steps before the episode is truncated (``sample.metadata`` may lower it)."""
    max_tokens_per_turn: int | None = Field(None, ge=1)
    """Cap of one turn's ``max_new_tokens`` (None: what is left of slime's response budget)."""
    max_rollbacks: int = Field(16, ge=0)
    """Env rollbacks one episode may take; past it the episode is given up as unrecoverable."""
    checkpoint_policy: str = "adaptive"
    env: dict[str, Any] = Field(default_factory=dict)
    """``EnvConfig`` fields (``sandbox`` image and limits, ``recovery_attempts``, ...)."""
    faults: dict[str, Any] | None = None
    """``FaultInjectionConfig`` fields: real faults into each episode's sandbox (chaos runs)."""


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    """slime's ``--custom-generate-function-path`` entry: ``run_episode`` with
    ``args.belayer_episode`` (default ``EpisodeConfig()``)."""
    config = getattr(args, "belayer_episode", None) or EpisodeConfig()
    if isinstance(config, dict):
        config = EpisodeConfig(**config)
    return await run_episode(args, sample, sampling_params, config)


async def run_episode(args: Any, sample: Any, sampling_params: dict[str, Any], config: EpisodeConfig) -> Any:
    from belayer.wrappers.chat_history import parse_bash_block
    from belayer_env import RecoverableSandboxEnv
    from belayer_env.env import CommandReward, EnvConfig

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
    test = meta.get("test_command")
    env = RecoverableSandboxEnv(EnvConfig(**{**config.env, "max_steps": int(meta.get("max_turns", config.max_turns))}),
                                checkpoint_policy=config.checkpoint_policy,
                                reward=CommandReward(test) if test else None)
    if config.faults is not None:
        from belayer.wrappers.fault_injection import FaultInjection, FaultInjectionConfig

        env = FaultInjection(env, FaultInjectionConfig(**config.faults))
    out = _Response()
    label: dict[str, Any] = {"rollbacks": [], "worker_recoveries": 0}
    end, reward = status.TRUNCATED, 0.0
    try:
        options = {"task": str(meta.get("task", "")), **{k: meta[k] for k in ("setup", "image") if meta.get(k)}}
        await asyncio.to_thread(env.reset, options=options)
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
            if rollback is not None:  # the sandbox is at boundary j: so is the sample
                j = rollback["to_step"]
                label["rollbacks"].append({"to_step": j, "reason": rollback["reason"], "tokens_cut": out.cut(j)})
                if len(label["rollbacks"]) > config.max_rollbacks:
                    raise _Unrecoverable(f"more than {config.max_rollbacks} rollbacks")
                continue
            if terminated or truncated:
                end, reward = (status.COMPLETED if terminated else status.TRUNCATED), float(step_reward)
                break
            out.observation(codec, obs)
            out.commit(step_info["belayer"]["step"])
    except (InfraError, _Unrecoverable) as e:  # recovery is exhausted: kept out of the loss
        # (remove_sample); the 0.0 only fills slime's reward arithmetic, as its coding-agent example does
        out.cut(out.boundary)
        end, reward = status.ABORTED, 0.0
        sample.remove_sample = True
        label["failed"] = str(e) if isinstance(e, _Unrecoverable) else type(e).__name__
    finally:
        await asyncio.to_thread(env.close)
    trajectory = env.unwrapped.trajectory
    label.update(turns=len(trajectory.steps), recovered=trajectory.recovered)
    _write(sample, prompt_ids, out, end, reward, {**meta, "belayer": label})
    return sample


class _Unrecoverable(Exception):
    """The episode's rollback budget is spent (``EpisodeConfig.max_rollbacks``)."""


class _Response:
    """The sample's response side, with its length at every committed env boundary."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.text: list[str] = []
        self.versions: list[str] = []
        self.marks: list[tuple[int, int, int]] = [(0, 0, 0)]  # boundary j -> (ids, text, versions)

    @property
    def boundary(self) -> int:
        return len(self.marks) - 1

    def model(self, triples: list, text: str, version: str | None) -> None:
        self.ids += [int(t[1]) for t in triples]
        self.logprobs += [float(t[0]) for t in triples]
        self.mask += [1] * len(triples)
        self.text.append(text)
        if version is not None:
            self.versions.append(version)

    def observation(self, codec: Any, observation: str) -> None:
        close = [] if self.ids and self.ids[-1] in codec.encode("<|im_end|>") else codec.encode("<|im_end|>")
        ids = close + codec.encode("\n") + codec.render_chat([{"role": "user", "content": observation}])
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.text.append(codec.decode_output(ids, skip_special_tokens=False))

    def commit(self, step: int) -> None:
        self.marks.append((len(self.ids), len(self.text), len(self.versions)))
        assert step == self.boundary, (step, self.boundary)

    def cut(self, j: int) -> int:
        """Back to boundary ``j``; returns how many tokens went."""
        n_ids, n_text, n_versions = self.marks[j]
        cut = len(self.ids) - n_ids
        for seq, n in ((self.ids, n_ids), (self.mask, n_ids), (self.logprobs, n_ids), (self.text, n_text),
                       (self.versions, n_versions)):
            del seq[n:]
        del self.marks[j + 1:]
        return cut


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
        return await _post_json(url, payload)
    return await post(url, payload)


async def _post_json(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session, \
            session.post(url, json=payload) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise RequestFailed(f"POST {url}: HTTP {resp.status}: {body[:500]}")
        return json.loads(body)
