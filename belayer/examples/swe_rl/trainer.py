"""The learner process: rollouts -> GRPO update -> versioned weight push -> async checkpoint.

The orchestrator starts ``learner_process`` as a separate process (``multiprocessing``,
spawn) with the run's ``RunConfig``, so that it can be SIGKILLed and restarted for real.
On start it resumes from the newest complete checkpoint (interrupted saves are removed,
never read); otherwise it plays the expert, runs the supervised warm start and saves
step 0. Progress goes to an append-only JSON-lines event log that survives the process.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import openai
import torch

from belayer_engine.weights.client import EngineWeights

from . import learner_ckpt
from .agent import make_env, run_episode
from .config import RunConfig
from .episode import Episode
from .expert import expert_dataset
from .faults import wrap_env
from .learner import Learner
from .tasks import Task, sample_tasks


class EventLog:
    """Append-only JSON lines, flushed per event (the orchestrator tails it)."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, event: dict) -> None:
        with open(self.path, "a") as f:  # one complete line per write; nothing buffered at a SIGKILL
            f.write(json.dumps({"wall": time.time(), **event}) + "\n")


def rollout_group(cfg: RunConfig, client: openai.OpenAI, tasks: list[Task], version: int,
                  step: int) -> tuple[list[list[Episode]], int]:
    """``group_size`` episodes per task, all from weight ``version``; returns groups, faults fired.

    An episode's env is closed (its sandbox, spare, standby and checkpoints removed) on a
    thread of its own, so that the episode's thread starts the next episode at once; the
    step waits for every close before it returns, and a close's error fails the step as
    before (a close also waits for this process's other background removals)."""
    jobs = [(t, i) for t in tasks for i in range(cfg.group_size)]
    closing: list[Future] = []

    def one(job: tuple[Task, int]) -> tuple[Episode, int]:
        task, i = job
        seed = cfg.seed * 1_000_003 + step * 1009 + i * 31 + zlib.crc32(task.id.encode())
        env = wrap_env(make_env(task, cfg.agent), cfg.faults, seed=seed)
        try:
            return run_episode(env, client, task, cfg.agent, expect_version=version), len(env.injected)
        finally:
            closing.append(closer.submit(env.close))

    # leaving the block waits for the episodes, then for every close (the closer exits last)
    with ThreadPoolExecutor(cfg.parallel, thread_name_prefix="env-close") as closer, \
            ThreadPoolExecutor(cfg.parallel) as pool:
        results = list(pool.map(one, jobs))
    for f in closing:
        f.result()  # raises a close's error
    episodes = [e for e, _ in results]
    groups = [episodes[k * cfg.group_size:(k + 1) * cfg.group_size] for k in range(len(tasks))]
    return groups, sum(n for _, n in results)


def warm_start(cfg: RunConfig, learner: Learner, tasks: list[Task], log: EventLog) -> None:
    cache = Path(cfg.out_dir) / "expert.json"
    if cache.is_file():
        episodes = [Episode.model_validate(e) for e in json.loads(cache.read_text())]
    else:
        episodes = expert_dataset(tasks, cfg.agent)
        cache.write_text(json.dumps([e.model_dump() for e in episodes]))
    log({"event": "expert", "episodes": len(episodes)})
    t0 = time.monotonic()
    loss = learner.sft(episodes, log=log)
    log({"event": "sft_done", "loss": round(loss, 4), "seconds": round(time.monotonic() - t0, 1)})


def learner_process(cfg: RunConfig, base_url: str, weights_socket: str) -> None:
    """The learner process's entry point; its output goes to ``OUT_DIR/learner.log``."""
    with open(Path(cfg.out_dir) / "learner.log", "a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    train(cfg, base_url, weights_socket)


def train(cfg: RunConfig, base_url: str, weights_socket: str) -> None:
    """Train for ``cfg.steps`` steps against the engine at ``base_url``; weights go to every
    slot through the engine's ``weights_socket`` (kept there, so a slot whose arena is
    cold-restarted serves them too; a push to one arena would be forgotten)."""
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    log = EventLog(out / "events.jsonl")
    ckpt_dir = out / "learner_ckpt"
    discarded = learner_ckpt.clean_incomplete(ckpt_dir)
    latest = learner_ckpt.latest_complete(ckpt_dir)
    learner = Learner(cfg.learner)
    tasks = sample_tasks(cfg.n_tasks, cfg.seed)
    saver = learner_ckpt.LearnerCheckpointer(learner_ckpt.LearnerCheckpointConfig(directory=str(ckpt_dir)))
    if latest is not None:
        learner.restore(learner_ckpt.load(latest))
        log({"event": "resumed", "step": learner.step, "checkpoint": latest.name, "discarded": discarded})
    else:
        log({"event": "learner_start"})
        warm_start(cfg, learner, tasks, log)
        saver.save_async(0, learner.snapshot())
        saver.wait()
    engine = EngineWeights(weights_socket)
    version = engine.update_weights(learner.model.hf_state_dict())
    log({"event": "weights", "step": learner.step, "version": version})
    client = openai.OpenAI(base_url=base_url, api_key="belayer", max_retries=0, timeout=120)
    for step in range(learner.step + 1, cfg.steps + 1):
        t0 = time.monotonic()
        rng = random.Random(cfg.seed * 7919 + step)  # a re-run step after a resume sees the same tasks
        groups, fired = rollout_group(cfg, client, rng.sample(tasks, cfg.tasks_per_step), version, step)
        t_roll = time.monotonic() - t0
        episodes = [e for g in groups for e in g]
        scored = [e for e in episodes if e.trainable]
        t1 = time.monotonic()
        metrics = learner.grpo_step(groups)
        t2 = time.monotonic()
        version = engine.update_weights(learner.model.hf_state_dict())
        t_push = time.monotonic() - t2
        log({"event": "saving", "step": step})
        saver.save_async(step, learner.snapshot())  # written while the next step rolls out
        log({
            "event": "step", "step": step, "version": version,
            "reward": round(statistics.fmean(e.reward for e in scored), 4) if scored else None,
            "episodes": len(episodes), "scored": len(scored),
            "env_faults": fired, "env_recoveries": sum(e.env_rollbacks for e in episodes),
            "worker_recoveries_seen": sum(e.worker_recoveries for e in episodes),
            "infra_labelled": sum(e.infra_touched for e in episodes),
            "unrecovered": sum(e.failed is not None for e in episodes),
            "stale": sum(e.stale for e in episodes),
            "env_lost_s": round(sum(e.lost_s for e in episodes), 3),
            "env_lost_s_without": round(sum(e.lost_s_without for e in episodes), 3),
            "mean_episode_s": round(statistics.fmean(e.seconds for e in episodes), 3),
            "rollbacks": [r for e in episodes for r in e.rollbacks],  # per env rollback, for the analysis
            "rollout_s": round(t_roll, 2), "learn_s": round(t2 - t1, 2), "push_s": round(t_push, 2), "seconds": round(time.monotonic() - t0, 2), **metrics,
        })
    saver.wait()
    log({"event": "done", "step": learner.step, "version": version,
         "ckpt_save_s": round(statistics.fmean(saver.save_seconds), 3) if saver.save_seconds else None})
