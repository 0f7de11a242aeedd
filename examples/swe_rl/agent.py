"""The agent loop: ordinary ``openai``-client code against the engine, wrapped for recovery.

One shell command per assistant message. Engine failures are invisible here (the router
continues a broken response token by token on the shadow worker); environment failures
come back as ``info["belayer"]["rollback"]``, and the loop truncates its messages to the
same prefix and regenerates from there, never replaying lost actions. What could not be
recovered is labelled and dropped, never scored as a failed attempt.
"""

from __future__ import annotations

import time

import openai
from pydantic import BaseModel, Field

from belayer.errors import BelayerError, InfraError
from belayer_engine.model.chat_template import apply_chat_template
from belayer_engine.model.tokenizer import ByteTokenizer
from belayer_env.config import SandboxConfig
from belayer_env.env import EnvConfig, RecoverableSandboxEnv
from belayer_env.rewards import CommandReward
from examples.swe_rl.episode import Episode, Turn
from examples.swe_rl.tasks import REPO_DIR, Task

_TOK = ByteTokenizer()


class AgentConfig(BaseModel):
    """Sampling and episode bounds (short: bytes are tokens for the embedded model)."""

    model: str = "belayer-default"
    max_tokens: int = Field(default=48, ge=1)
    temperature: float = 1.0
    max_turns: int = Field(default=4, ge=1)
    command_timeout_s: float = 10.0
    checkpoint_policy: str = "adaptive"


def render_prompt_ids(messages: list[dict]) -> list[int]:
    """Exactly the ids the router feeds the model for ``messages`` (same template, tokenizer)."""
    return _TOK.encode(apply_chat_template(messages))


def make_env(task: Task, cfg: AgentConfig | None = None, **env_options) -> RecoverableSandboxEnv:
    cfg = cfg or AgentConfig()
    sandbox = SandboxConfig(cwd=REPO_DIR, timeout=cfg.command_timeout_s, memory="256m")
    env = RecoverableSandboxEnv(EnvConfig(sandbox=sandbox, max_steps=cfg.max_turns, **env_options),
                                checkpoint_policy=cfg.checkpoint_policy,
                                reward=CommandReward(task.test_command, timeout=cfg.command_timeout_s))
    return env


def run_episode(env, client: openai.OpenAI, task: Task, cfg: AgentConfig,
                expect_version: int | None = None, seed: int | None = None) -> Episode:
    """Roll out one task with ``env`` (reset here) and the OpenAI-compatible ``client``."""
    started = time.monotonic()
    episode = Episode(task_id=task.id)
    env.unwrapped.reward_fn = CommandReward(task.test_command, timeout=cfg.command_timeout_s)
    try:
        obs, _ = env.reset(options=task.reset_options())
        messages = [{"role": "user", "content": obs}]
        turns: list[Turn] = []
        reached = [time.monotonic()]  # reached[j]: when boundary j was (re)established
        from_scratch = started
        for _ in range(cfg.max_turns * 3):  # bounded even with repeated rollbacks
            prompt_ids = render_prompt_ids(messages)
            resp = client.chat.completions.create(
                model=cfg.model, messages=messages, max_tokens=cfg.max_tokens,
                temperature=cfg.temperature, seed=seed, extra_body={"return_token_ids": True})
            meta = (resp.model_extra or {}).get("belayer") or {}
            version = meta.get("weight_version")
            if expect_version is not None and version != expect_version:
                episode.stale = True
            recovered = int(meta.get("recoveries") or 0)
            episode.worker_recoveries += recovered
            if recovered:
                episode.infra_events.append(f"worker_recovered@turn{len(turns) + 1}")
            choice = resp.choices[0]
            ids = list((choice.model_extra or {}).get("token_ids") or [])
            action = (choice.message.content or "").replace("\x00", "").strip() or "true"
            turns.append(Turn(prompt_ids=prompt_ids, completion_ids=ids, weight_version=version,
                              worker_recoveries=recovered))
            obs, reward, terminated, truncated, info = env.step(action)
            rollback = info.get("belayer", {}).get("rollback")
            if rollback:  # the env restored boundary j: drop turns j+1.. and regenerate them
                j, now = int(rollback["to_step"]), time.monotonic()
                episode.lost_s += now - reached[j]
                episode.lost_s_without += now - from_scratch
                reached, from_scratch = reached[:j] + [now], now
                episode.env_rollbacks += 1
                episode.infra_events.append(f"env_rollback:{rollback['reason']}->step{j}")
                del turns[j:]
                messages = messages[: 1 + 2 * j]
                continue
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]
            reached.append(time.monotonic())
            if terminated or truncated:
                episode.reward = float(reward)
                break
        episode.turns = turns
    except (InfraError, openai.APIError, BelayerError) as exc:
        episode.failed = f"{type(exc).__name__}: {str(exc)[:200]}"
        episode.infra_events.append(f"unrecovered:{type(exc).__name__}")
    episode.seconds = time.monotonic() - started
    return episode
