"""One figure per run: reward over wall-clock time with fault/recovery events on the same
timeline, and time lost to failures with Belayer vs. without it (estimated)."""

from __future__ import annotations

from pathlib import Path


def plot_run(events: list[dict], engine_events: list[dict], worker_kills: list[dict],
             learner_kills: list[dict], summary: dict, path: Path, t0: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2.2, 1]})
    steps = {}
    for e in events:
        if e["event"] == "step" and e["reward"] is not None:
            steps[e["step"]] = e
    xs = [e["wall"] - t0 for e in steps.values()]
    ax.plot(xs, [e["reward"] for e in steps.values()], "o-", color="tab:blue", label="mean reward (scored episodes)")
    for s, e in steps.items():
        ax.annotate(str(s), (e["wall"] - t0, e["reward"]), textcoords="offset points", xytext=(0, 6),
                    fontsize=7, ha="center")
        if e["env_faults"]:
            ax.scatter([e["wall"] - t0], [-0.06], marker="v", color="tab:orange", s=14 * e["env_faults"])
    ax.scatter([], [], marker="v", color="tab:orange", label="env faults (size = count, at step end)")
    for i, k in enumerate(worker_kills):
        ax.axvline(k["wall"] - t0, color="tab:red", lw=0.8, ls="--", label="worker SIGKILL -> shadow" if i == 0 else None)
    for i, k in enumerate(learner_kills):
        ax.axvline(k["wall"] - t0, color="black", lw=1.2, label="learner SIGKILL -> resume" if i == 0 else None)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("reward (tests pass)")
    ax.set_ylim(-0.12, 1.08)
    ax.set_title(f"SWE agent GRPO under injected faults ({summary['steps']} steps)")
    ax.legend(fontsize=7, loc="upper left")

    kinds = ["env", "worker", "learner"]
    with_b = [summary["time_lost_s"]["with_belayer"][k] for k in kinds]
    without = [summary["time_lost_s"]["without_belayer_estimated"][k] for k in kinds]
    pos = range(len(kinds))
    bx.bar([p - 0.2 for p in pos], without, width=0.4, color="tab:gray", label="without Belayer (estimated)")
    bx.bar([p + 0.2 for p in pos], with_b, width=0.4, color="tab:green", label="with Belayer (measured)")
    bx.set_xticks(list(pos), kinds)
    bx.set_ylabel("seconds lost to failures")
    bx.set_title("time lost")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
