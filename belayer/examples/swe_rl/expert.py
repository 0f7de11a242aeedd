"""Scripted expert trajectories, played through the real env so observations are genuine.

The expert reads the file, applies the one-line fix and submits (the reward runs the tests). Its
conversations are the supervised warm start that gives RL a non-zero success rate.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from belayer_engine.model.chat_template import IM_END

from .config import AgentConfig
from .episode import Episode, Turn
from .tasks import SUBMIT, Task


def expert_actions(task: Task) -> list[str]:
    return [f"cat {task.source_file}", task.fix_command(), SUBMIT]


def play_expert(task: Task, cfg: AgentConfig | None = None) -> Episode:
    """Run the expert's actions in a fresh sandbox; the episode must earn reward 1."""
    from belayer.wrappers.chat_history import ChatHistory

    from .agent import CODEC, make_env, shell_command

    env = ChatHistory(make_env(task, cfg or AgentConfig()), parse_action=shell_command)
    try:
        env.reset(options=task.reset_options())
        episode = Episode(task_id=task.id)
        for action in expert_actions(task):
            # what the model should generate: the command, then the end of its message
            episode.turns.append(Turn(prompt_ids=CODEC.render_chat(env.messages),
                                      completion_ids=CODEC.encode(action + IM_END), weight_version=None))
            _, reward, terminated, truncated, info = env.step(action)
            if info.get("belayer", {}).get("rollback"):
                raise RuntimeError(f"expert episode {task.id} hit an infra failure")
            if terminated or truncated:
                episode.reward = float(reward)
                break
        return episode
    finally:
        env.close()


def expert_dataset(tasks: list[Task], cfg: AgentConfig | None = None, threads: int = 2) -> list[Episode]:
    """Expert episodes for ``tasks`` (only the successful ones are kept)."""
    with ThreadPoolExecutor(threads) as pool:
        episodes = list(pool.map(lambda t: play_expert(t, cfg), tasks))
    return [e for e in episodes if e.reward == 1.0]
