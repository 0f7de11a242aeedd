"""The run's JSON summary, computed only from recorded events (learner log, supervisor).

Time lost to failures is measured with Belayer and estimated without it:
- env: work after the restored boundary (with) vs. since the episode's start (without:
  a fresh container and a restart from scratch), both measured per rollback;
- worker: the handover's kill-to-serving time (with) vs. a cold engine restart plus the
  in-flight episodes that a broken response would have failed (without, estimated from
  the measured cold start and mean episode time);
- learner: restart + work since the resumed checkpoint (with) vs. restart + everything
  since the learner started (without checkpoints).
"""

from __future__ import annotations


def _last_per_step(events: list[dict]) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for ev in events:
        if ev["event"] == "step":
            steps[ev["step"]] = ev  # a step re-run after a resume replaces the lost one
    return dict(sorted(steps.items()))


def learner_losses(events: list[dict], kills: list[dict]) -> list[dict]:
    """Per learner kill: restart time, work redone (with) and work lost without checkpoints."""
    out = []
    start = next((e["wall"] for e in events if e["event"] == "learner_start"), None)
    for kill in kills:
        resumed = next((e for e in events if e["event"] == "resumed" and e["wall"] > kill["wall"]), None)
        if resumed is None or start is None:
            continue
        step = resumed["step"]
        marks = [e["wall"] for e in events if e["wall"] < kill["wall"]
                 and ((e["event"] == "step" and e["step"] == step) or (step == 0 and e["event"] == "sft_done"))]
        reached = marks[-1] if marks else start
        restart = resumed["wall"] - kill["wall"]
        out.append({"killed_at_step": kill["step"], "resumed_from_step": step, "restart_s": round(restart, 2),
                    "lost_s": round(restart + kill["wall"] - reached, 2),
                    "lost_s_without": round(restart + kill["wall"] - start, 2)})
    return out


def summarize(events: list[dict], engine_events: list[dict], worker_kills: list[dict],
              learner_kills: list[dict], *, seconds: float, engine_start_s: float, parallel: int) -> dict:
    steps = _last_per_step(events)
    all_steps = [e for e in events if e["event"] == "step"]
    rewards = [s["reward"] for s in steps.values() if s["reward"] is not None]
    handovers = [e for e in engine_events if e["event"] == "handover"]
    cold = [e for e in engine_events if e["event"] == "cold_restart"]
    mean_episode = (sum(s["mean_episode_s"] for s in all_steps) / len(all_steps)) if all_steps else 0.0
    learner = learner_losses(events, learner_kills)
    lost_with = {
        "env": round(sum(s["env_lost_s"] for s in all_steps), 2),
        "worker": round(sum(h.get("total_s", 0.0) for h in handovers), 2),
        "learner": round(sum(x["lost_s"] for x in learner), 2),
    }
    lost_without = {
        "env": round(sum(s["env_lost_s_without"] for s in all_steps), 2),
        "worker": round(len(worker_kills) * (engine_start_s + parallel * mean_episode / 2), 2),
        "learner": round(sum(x["lost_s_without"] for x in learner), 2),
    }
    sft = next((e for e in events if e["event"] == "sft_done"), {})
    return {
        "steps": len(steps),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_by_step": {k: v["reward"] for k, v in steps.items()},
        "env_faults": sum(s["env_faults"] for s in all_steps),
        "env_recoveries": sum(s["env_recoveries"] for s in all_steps),
        "worker_faults": len(worker_kills),
        "worker_recoveries": len(handovers) + len(cold),
        "worker_continued_responses": sum(s["worker_recoveries_seen"] for s in all_steps),
        "learner_resumes": sum(e["event"] == "resumed" for e in events),
        "learner": learner,
        "infra_labelled": sum(s["infra_labelled"] for s in all_steps),
        "unrecovered_dropped": sum(s["unrecovered"] for s in all_steps),
        "stale_dropped": sum(s["stale"] for s in all_steps),
        "episodes": sum(s["episodes"] for s in all_steps),
        "sft_seconds": sft.get("seconds"),
        "engine_start_s": round(engine_start_s, 2),
        "time_lost_s": {"with_belayer": lost_with, "without_belayer_estimated": lost_without},
        "seconds": round(seconds, 1),
    }
