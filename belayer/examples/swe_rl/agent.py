"""The agent loop: ordinary ``openai``-client code against the engine, wrapped for recovery.

One shell command per assistant message. ``ChatHistory`` owns the messages: when the env
restores boundary j after a failure (``info["belayer"]["rollback"]``) it cuts them back to
boundary j, and the loop drops the turns sampled after it and regenerates from there,
never replaying lost actions. Engine failures are invisible here (the router continues a
broken response token by token on the shadow worker). What could not be recovered is
labelled and dropped, never scored as a failed attempt.
"""

from __future__ import annotations

import threading
import time

import gymnasium as gym
import openai

from belayer.wrappers.chat_history import ChatHistory, parse_bash_block
from belayer_core.errors import BelayerError, InfraError
from belayer_engine.router.codec import load_codec
from belayer_env.env.policy import AdaptivePolicy, PolicyEstimates
from belayer_env.env.recoverable import EnvConfig, RecoverableSandboxEnv
from belayer_env.env.rewards import CommandReward
from belayer_env.sandbox.config import SandboxConfig

from .config import AgentConfig
from .episode import Episode, Turn
from .tasks import REPO_DIR, Task

CODEC = load_codec(None)
"""The router's own codec for the embedded model: ``CODEC.render_chat(messages)`` gives
exactly the prompt ids the router feeds the worker for those messages."""


def shell_command(reply: str) -> str:
    """The command in a reply: its last fenced bash block, else the reply (``true`` if empty)."""
    return parse_bash_block(reply).strip() or "true"


ESTIMATES = PolicyEstimates()
"""What the adaptive checkpoint policies of this process's envs learned (failure rate,
capture and generation times), shared: one env lives one episode, too short to learn them."""


def make_env(task: Task, cfg: AgentConfig) -> RecoverableSandboxEnv:
    """A sandbox env for ``task``: the repo's directory, limits, and its tests as the reward."""
    sandbox = SandboxConfig(cwd=REPO_DIR, timeout=cfg.command_timeout_s, memory="256m")
    policy = AdaptivePolicy(estimates=ESTIMATES) if cfg.checkpoint_policy == "adaptive" else cfg.checkpoint_policy
    return RecoverableSandboxEnv(EnvConfig(sandbox=sandbox, max_steps=cfg.max_turns, standby=cfg.standby,
                                           restore_spare=cfg.restore_spare, recover_while_idle=cfg.recover_while_idle),
                                 checkpoint_policy=policy,
                                 reward=CommandReward(task.test_command, timeout=cfg.command_timeout_s))


def _env_events(env: gym.Env, since: int) -> list[dict]:
    """The env's infra events (checkpoints, restores, standby) after the first ``since``."""
    events = getattr(env.unwrapped, "trajectory", None)
    events = events.events if events is not None else []
    return [{"kind": e.kind, "at": e.at_step, **({"to": e.to_step} if e.to_step is not None else {}),
             **({"error": f"{e.error}: {(e.message or '')[:160]}"} if e.error else {})} for e in events[since:] if e.kind != "rollback"]


def _last_rollback(env: gym.Env):
    """The env's latest rollback event (None when the env keeps none)."""
    events = getattr(getattr(env.unwrapped, "trajectory", None), "events", [])
    return next((e for e in reversed(events) if e.kind == "rollback"), None)


def _recovery_parts(env: gym.Env) -> dict[str, float]:
    """Where the latest rollback's recovery time went (fence, wait_capture, restore, initial)."""
    return dict(getattr(_last_rollback(env), "recovery_parts", None) or {})


def _recovery_s(env: gym.Env) -> float:
    """Fence + restore time of the env's latest rollback that the agent's step call spent (0
    when the env does not say): all of it, or what the call waited of a restore begun while
    the model generated (``recover_while_idle``)."""
    last = _last_rollback(env)
    if last is None:
        return 0.0
    return (last.waited_s or 0.0) if getattr(last, "while_idle", False) else (last.recovery_s or 0.0)


class _Active:
    """How many episodes (sandboxes) are running at once: the load a rollback happened under."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def __enter__(self) -> int:
        with self._lock:
            self.n += 1
            return self.n

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.n -= 1


ACTIVE = _Active()


def run_episode(env: gym.Env, client: openai.OpenAI, task: Task, cfg: AgentConfig,
                expect_version: int | None = None, seed: int | None = None) -> Episode:
    """Roll out one task with ``env`` (reset here) and the OpenAI-compatible ``client``.

    Per rollback it records (``Episode.rollbacks``) where the fault hit, which boundary was
    restored, how long the failed step and its recovery took and, once the lost steps are
    regenerated, how long that took.
    """
    with ACTIVE:
        return _run_episode(env, client, task, cfg, expect_version, seed)


def _run_episode(env: gym.Env, client: openai.OpenAI, task: Task, cfg: AgentConfig,
                 expect_version: int | None, seed: int | None) -> Episode:
    started = time.monotonic()
    episode = Episode(task_id=task.id)
    chat = ChatHistory(env, parse_action=shell_command)
    try:
        chat.reset(options=task.reset_options())
        turns: list[Turn] = []
        ready = time.monotonic()
        reset_s = ready - started  # what a restart from scratch costs: fresh sandbox + setup
        # reached[j]: since when a rollback to j throws work away. A rollback to 0 onto a fresh
        # sandbox discards the sandbox's creation and setup too: boundary 0 counts from the
        # reset's start (from its end when boundary 0's checkpoint is restored)
        reached = [started]
        done_at = [ready]  # done_at[j]: when boundary j was reached on the current branch
        from_scratch = started  # without Belayer: when the episode's current attempt began
        seen_events = 0
        regenerating: list[dict] = []  # rollbacks whose lost steps are not regenerated yet
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
            called = time.monotonic()
            _, reward, terminated, truncated, info = chat.step(choice.message.content or "")
            rollback = info.get("belayer", {}).get("rollback")
            idle = info.get("belayer", {}).get("recovered_while_idle")
            if idle and not rollback:  # died while the model generated, restored at this boundary:
                k, now = len(turns) - 1, time.monotonic()  # only the restore's unhidden part was lost
                waited = _recovery_s(env)
                # without Belayer this call would have found the sandbox dead: all of the attempt
                # up to it, then a fresh sandbox and the setup again
                lost_without = called + waited - from_scratch + reset_s
                episode.lost_s += waited
                episode.lost_s_without += lost_without
                events = _env_events(env, seen_events)
                seen_events = len(env.unwrapped.trajectory.events)
                episode.rollbacks.append({
                    "fault_step": k + 1, "to_step": k, "lost_s": round(waited, 3), "lost_s_without": round(lost_without, 3),
                    "since_boundary_s": round(called - done_at[k], 3), "step_call_s": round(now - called, 3),
                    "recovery_s": round(waited, 3), "recovery_parts": _recovery_parts(env), "reset_s": round(reset_s, 3),
                    "while_idle": True,
                    "active_episodes": ACTIVE.n, "env_events": events, "reason": idle["reason"]})
                from_scratch = called + waited - (done_at[k] - done_at[0])
                episode.env_rollbacks += 1
                episode.infra_events.append(f"env_restored_while_idle:{idle['reason']}->step{k}")
            if rollback:  # the env restored boundary j and chat cut its messages to match
                k, j, now = len(turns) - 1, chat.boundary, time.monotonic()
                # boundary 0 restored from its checkpoint keeps the setup; a fresh one does not
                kept_setup = j == 0 and getattr(env.unwrapped.sandbox, "restored_from", None) is not None
                lost = now - (done_at[0] if kept_setup else reached[j])  # work after j, the failed step, recovery
                # without Belayer: everything since the episode's attempt began, up to the
                # fault's detection (the failed step ran that long in both worlds), then a fresh
                # sandbox and the task's setup again (as long as this episode's own reset took)
                lost_without = now - _recovery_s(env) - from_scratch + reset_s
                episode.lost_s += lost
                episode.lost_s_without += lost_without
                events = _env_events(env, seen_events)
                seen_events = len(env.unwrapped.trajectory.events) if hasattr(env.unwrapped, "trajectory") else 0
                record = {"fault_step": k + 1, "to_step": j, "lost_s": round(lost, 3),
                          "lost_s_without": round(lost_without, 3), "since_boundary_s": round(called - done_at[j], 3),
                          "step_call_s": round(now - called, 3), "recovery_s": round(_recovery_s(env), 3),
                          "recovery_parts": _recovery_parts(env),
                          "reset_s": round(reset_s, 3),
                          "active_episodes": ACTIVE.n, "env_events": events,
                          "reason": rollback["reason"]}
                episode.rollbacks.append(record)
                if j < k:
                    regenerating.append(record)
                # without Belayer, the restarted attempt would redo boundaries 1..j as well
                from_scratch = now - (done_at[j] - done_at[0])
                reached, done_at = reached[:j] + [now], done_at[:j] + [now]
                episode.env_rollbacks += 1
                episode.infra_events.append(f"env_rollback:{rollback['reason']}->step{j}")
                del turns[j:]  # the samples of the lost steps; they are generated again
                continue
            reached.append(time.monotonic())
            done_at.append(reached[-1])
            for record in [r for r in regenerating if len(reached) - 1 >= r["fault_step"] - 1]:
                record["regenerate_s"] = round(reached[-1] - done_at[record["to_step"]], 3)
                regenerating.remove(record)
            if terminated or truncated:
                episode.reward = float(reward)
                break
        episode.turns = turns
    except (InfraError, openai.APIError, BelayerError) as exc:
        episode.failed = f"{type(exc).__name__}: {str(exc)[:200]}"
        episode.infra_events.append(f"unrecovered:{type(exc).__name__}")
    episode.seconds = time.monotonic() - started
    return episode
