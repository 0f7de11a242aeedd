"""What the token-level trainer adapters (slime, verl) share: one episode's config, its env
(the sandbox under ``InfraPolicy``), and its token record cut back on a rollback.

An episode is a sample: the model's turns (token ids from the engine) interleaved with the
observations of the bash commands they contain, each command one step of a
``RecoverableSandboxEnv``. Per sample, the trainer's row metadata may give ``task``,
``setup``, ``image``, ``test_command`` (reward 1.0 when it exits 0 at submit) and
``max_turns``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from belayer.wrappers.infra_policy import InfraPolicy, PolicyEnv

TASK_KEYS = ("task", "setup", "image", "test_command", "max_turns")


class EpisodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(16, ge=1)
    """Committed env steps before the episode is truncated (the sample's metadata may lower it)."""
    max_tokens_per_turn: int | None = Field(None, ge=1)
    """Cap of one turn's new tokens (None: what is left of the trainer's response budget)."""
    checkpoint_policy: str = "adaptive"
    env: dict[str, Any] = Field(default_factory=dict)
    """``EnvConfig`` fields (``sandbox`` image and limits, ``recovery_attempts``, ...)."""
    faults: dict[str, Any] | None = None
    """``FaultInjectionConfig`` fields: real faults into each episode's sandbox (chaos runs)."""
    infra: InfraPolicy = Field(default_factory=InfraPolicy)
    """What happens to a sample whose env recovery is exhausted (retry with a fresh sandbox, then
    drop), and how many rollbacks one sandbox may take (``max_rollbacks``)."""


def episode_env(config: EpisodeConfig, meta: dict[str, Any]) -> PolicyEnv:
    """The sample's env: a ``RecoverableSandboxEnv`` (with ``faults`` injected, if any) under
    ``config.infra``; not reset yet."""
    from belayer_env import RecoverableSandboxEnv
    from belayer_env.env import CommandReward, EnvConfig

    test = meta.get("test_command")
    env = RecoverableSandboxEnv(EnvConfig(**{**config.env, "max_steps": int(meta.get("max_turns", config.max_turns))}),
                                checkpoint_policy=config.checkpoint_policy,
                                reward=CommandReward(test) if test else None)
    if config.faults is not None:
        from belayer.wrappers.fault_injection import FaultInjection, FaultInjectionConfig

        env = FaultInjection(env, FaultInjectionConfig(**config.faults))
    return PolicyEnv(env, config.infra)


def reset_options(meta: dict[str, Any]) -> dict[str, Any]:
    """``reset`` options from the sample's metadata (task text, setup, image)."""
    return {"task": str(meta.get("task", "")), **{k: meta[k] for k in ("setup", "image") if meta.get(k)}}


def observation_ids(last_ids: list[int], im_end: list[int], newline: list[int], user_turn: list[int]) -> list[int]:
    """The tokens that close the model's turn (``<|im_end|>`` unless it ended with it) and open
    the observation's: ``user_turn`` is a ChatML user message with the assistant prompt after it."""
    close = [] if last_ids and last_ids[-1] in im_end else list(im_end)
    return close + list(newline) + list(user_turn)


class TokenRecord:
    """Sequences that grow with an episode (ids, loss mask, logprobs, texts, versions, ...),
    with their lengths at every committed env boundary, cut back together on a rollback."""

    def __init__(self, **sequences: list) -> None:
        self.seqs = sequences
        self.marks = [self._lengths()]  # boundary j -> the lengths at j

    def __getattr__(self, name: str) -> list:
        seqs = self.__dict__.get("seqs", {})
        if name in seqs:
            return seqs[name]
        raise AttributeError(name)

    @property
    def boundary(self) -> int:
        return len(self.marks) - 1

    def commit(self, step: int) -> None:
        """The env committed ``step``: remember every length there."""
        self.marks.append(self._lengths())
        if step != self.boundary:
            raise AssertionError(f"env step {step} != record boundary {self.boundary}")

    def cut(self, j: int, count: str | None = None) -> int:
        """Back to boundary ``j``; returns how many items of ``count`` (default: the first
        sequence) went."""
        lengths = self.marks[j]
        key = count or next(iter(self.seqs))
        gone = len(self.seqs[key]) - lengths[key]
        for name, seq in self.seqs.items():
            del seq[lengths[name]:]
        del self.marks[j + 1:]
        return gone

    def _lengths(self) -> dict[str, int]:
        return {name: len(seq) for name, seq in self.seqs.items()}


async def post_json(url: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One JSON POST (SGLang's native ``/generate``); a non-200 answer is ``RequestFailed``."""
    import json

    import aiohttp

    from belayer_core.errors import RequestFailed

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session, \
            session.post(url, json=payload) as resp:
        body = await resp.text()
        if resp.status != 200:
            raise RequestFailed(f"POST {url}: HTTP {resp.status}: {body[:500]}")
        return json.loads(body)
