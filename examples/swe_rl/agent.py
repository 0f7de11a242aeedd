"""The agent loop: ordinary ``openai``-client code against the engine, wrapped for recovery.

One shell command per assistant message. ``ChatHistory`` owns the messages: when the env
restores boundary j after a failure (``info["belayer"]["rollback"]``) it cuts them back to
boundary j, and the loop drops the turns sampled after it and regenerates from there,
never replaying lost actions. Engine failures are invisible here (the router continues a
broken response token by token on the shadow worker). What could not be recovered is
labelled and dropped, never scored as a failed attempt.
"""

from __future__ import annotations

import time

import gymnasium as gym
import openai

from belayer.errors import BelayerError, InfraError
from belayer.wrappers.chat_history import ChatHistory, parse_bash_block
from belayer_engine.router.codec import load_codec
from belayer_env.config import SandboxConfig
from belayer_env.env import EnvConfig, RecoverableSandboxEnv
from belayer_env.rewards import CommandReward

from .config import AgentConfig
from .episode import Episode, Turn
from .tasks import REPO_DIR, Task

CODEC = load_codec(None)
"""The router's own codec for the embedded model: ``CODEC.render_chat(messages)`` gives
exactly the prompt ids the router feeds the worker for those messages."""


def shell_command(reply: str) -> str:
    """The command in a reply: its last fenced bash block, else the reply (``true`` if empty)."""
    return parse_bash_block(reply).strip() or "true"


def make_env(task: Task, cfg: AgentConfig) -> RecoverableSandboxEnv:
    """A sandbox env for ``task``: the repo's directory, limits, and its tests as the reward."""
    sandbox = SandboxConfig(cwd=REPO_DIR, timeout=cfg.command_timeout_s, memory="256m")
    return RecoverableSandboxEnv(EnvConfig(sandbox=sandbox, max_steps=cfg.max_turns),
                                 checkpoint_policy=cfg.checkpoint_policy,
                                 reward=CommandReward(task.test_command, timeout=cfg.command_timeout_s))


def run_episode(env: gym.Env, client: openai.OpenAI, task: Task, cfg: AgentConfig,
                expect_version: int | None = None, seed: int | None = None) -> Episode:
    """Roll out one task with ``env`` (reset here) and the OpenAI-compatible ``client``."""
    started = time.monotonic()
    episode = Episode(task_id=task.id)
    chat = ChatHistory(env, parse_action=shell_command)
    try:
        chat.reset(options=task.reset_options())
        turns: list[Turn] = []
        reached = [time.monotonic()]  # reached[j]: when boundary j was (re)established
        from_scratch = started
        for _ in range(cfg.max_turns * 3):  # bounded even with repeated rollbacks
            resp = client.chat.completions.create(
                model=cfg.model, messages=chat.messages, max_tokens=cfg.max_tokens,
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
            turns.append(Turn(prompt_ids=CODEC.render_chat(chat.messages),
                              completion_ids=list((choice.model_extra or {}).get("token_ids") or []),
                              weight_version=version, worker_recoveries=recovered))
            _, reward, terminated, truncated, info = chat.step(choice.message.content or "")
            rollback = info.get("belayer", {}).get("rollback")
            if rollback:  # the env restored boundary j and chat cut its messages to match
                j, now = chat.boundary, time.monotonic()
                episode.lost_s += now - reached[j]
                episode.lost_s_without += now - from_scratch
                reached, from_scratch = reached[:j] + [now], now
                episode.env_rollbacks += 1
                episode.infra_events.append(f"env_rollback:{rollback['reason']}->step{j}")
                del turns[j:]  # the samples of the lost steps; they are generated again
                continue
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
