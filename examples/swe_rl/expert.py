"""Scripted expert trajectories, played through the real env so observations are genuine.

The expert reads the file, applies the one-line fix and submits (the reward runs the tests). Its
conversations are the supervised warm start that gives RL a non-zero success rate.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from examples.swe_rl.episode import Episode, Turn
from examples.swe_rl.tasks import SUBMIT, Task


def expert_actions(task: Task) -> list[str]:
    return [f"cat {task.source_file}", task.fix_command(), SUBMIT]


def play_expert(task: Task, env_factory=None) -> Episode:
    """Run the expert's actions in a fresh sandbox; the episode must earn reward 1."""
    from belayer_engine.model.tokenizer import ByteTokenizer
    from examples.swe_rl.agent import make_env, render_prompt_ids

    env_factory = env_factory or make_env
    tok = ByteTokenizer()
    env = env_factory(task)
    try:
        obs, _ = env.reset(options=task.reset_options())
        messages = [{"role": "user", "content": obs}]
        episode = Episode(task_id=task.id)
        for action in expert_actions(task):
            ids = tok.encode(action) + [tok.special_ids["<|im_end|>"]]
            episode.turns.append(Turn(prompt_ids=render_prompt_ids(messages), completion_ids=ids,
                                      weight_version=None))
            obs, reward, terminated, truncated, info = env.step(action)
            if info.get("belayer", {}).get("rollback"):
                raise RuntimeError(f"expert episode {task.id} hit an infra failure")
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]
            if terminated or truncated:
                episode.reward = float(reward)
                break
        return episode
    finally:
        env.close()


def expert_dataset(tasks: list[Task], threads: int = 2) -> list[Episode]:
    """Expert episodes for ``tasks`` (only the successful ones are kept)."""
    with ThreadPoolExecutor(threads) as pool:
        episodes = list(pool.map(play_expert, tasks))
    return [e for e in episodes if e.reward == 1.0]
