"""Env recovery benchmark: rollout time under env failures, with and without Belayer.

Two parts, both reported:

1. **Measured** (real containers, real faults): a simulated agent loop (LLM think time
   drawn from a long-tailed lognormal, slept for real so captures run in the bubble;
   real bash actions: file edits, a git commit, a little compute) over
   RecoverableSandboxEnv. Fault-free runs with ``never`` vs ``adaptive`` give the adaptive
   policy's failure-free overhead (same think-time draws: common random numbers). Faulty
   runs kill the container during one uniformly chosen action per trajectory and measure
   what a failure costs: (a) no recovery = restart the trajectory from the base image
   (what ``never`` does: a fresh container + setup, then regenerate everything) vs (b)
   RecoverableSandboxEnv (adaptive checkpoints, restore, regenerate since j).
2. **Modelled** (Monte Carlo over the measured costs): 1% per-action failure rate,
   long-tailed think time at its real scale, many trajectories: rollout time vs
   fault-free for (a) and (b), and the recovery speedup.

    python benchmarks/env_recovery.py                 # ~4 min on 2 cores
    python benchmarks/env_recovery.py --quick         # ~1 min smoke run
Writes benchmarks/results/env_recovery.json and env_recovery.png (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_env.env.policy import AdaptivePolicy  # noqa: E402
from belayer_env.env.recoverable import RecoverableSandboxEnv  # noqa: E402
from belayer_env.faults.inject import kill_container  # noqa: E402
from benchmarks._plotting import save_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
THINK_MEDIAN_S, THINK_SIGMA = 2.0, 0.9  # lognormal: median 2 s, p99 ~16 s (agentic LLM turns)
SETUP = ("mkdir -p /repo && cd /repo && git init -q && git config user.email a@b && git config user.name a"
         " && for i in $(seq 200); do echo \"line $i\" > f$i.txt; done && git add -A && git commit -qm base")


def action(i: int) -> str:
    return (f"cd /repo && echo 'edit {i}' >> f{i % 200 + 1}.txt && python3 -c 'print(sum(range(200000)))'"
            f" && git add -A && git commit -qm 'step {i}' && git log --oneline | wc -l")


def think_times(rng: np.random.Generator, n: int, scale: float) -> list[float]:
    t = rng.lognormal(np.log(THINK_MEDIAN_S), THINK_SIGMA, n) * scale
    return [float(x) for x in np.minimum(t, 30 * scale)]


def run_trajectory(policy: str, thinks: list[float], fail_at: int | None) -> dict:
    """One trajectory; ``fail_at``: kill the container during that (1-based) action, once."""
    env = RecoverableSandboxEnv(checkpoint_policy=AdaptivePolicy() if policy == "adaptive" else "never")
    n = len(thinks)
    try:
        t0 = time.monotonic()
        env.reset(options={"setup": SETUP})
        committed, failed, recover_s, lost = 0, False, 0.0, 0
        while committed < n:
            time.sleep(thinks[committed])  # the LLM generating action committed+1
            if fail_at == committed + 1 and not failed:
                failed = True
                timer = threading.Timer(0.05, kill_container, args=(env.client, env.sandbox.container_id))
                timer.start()
                t_fail = time.monotonic()
                _obs, _r, _te, _tr, info = env.step(action(committed + 1) + " && sleep 0.2")
                timer.join()
                rb = info["belayer"].get("rollback")
                if rb is None:
                    raise RuntimeError("the injected fault did not cause a rollback")
                recover_s = time.monotonic() - t_fail
                lost = committed - rb["to_step"]
                committed = rb["to_step"]
                continue
            _obs, _r, _te, _tr, info = env.step(action(committed + 1))
            if "rollback" in info["belayer"]:
                raise RuntimeError(f"unexpected rollback: {info}")
            committed += 1
        total = time.monotonic() - t0
        ready = [e for e in env.trajectory.events if e.kind == "checkpoint_ready"]
        exec_s = [s.exec_s for s in env.trajectory.steps]
        return {"policy": policy, "total_s": total, "fail_at": fail_at, "recover_s": recover_s,
                "lost_steps": lost, "checkpoints": len(ready), "exec_s_mean": statistics.fmean(exec_s)}
    finally:
        env.close()


def measure(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    free, faulty = [], []
    for k in range(args.trajectories):
        thinks = think_times(rng, args.steps, args.think_scale)
        for policy in ("never", "adaptive"):
            free.append({"traj": k, **run_trajectory(policy, thinks, None)})
        fail_at = int(rng.integers(1, args.steps + 1))
        for policy in ("never", "adaptive"):
            faulty.append({"traj": k, **run_trajectory(policy, thinks, fail_at)})
        print(f"trajectory {k}: fault-free never {free[-2]['total_s']:.1f}s adaptive {free[-1]['total_s']:.1f}s; "
              f"fail@{fail_at}: never +{faulty[-2]['total_s'] - free[-2]['total_s']:.1f}s "
              f"adaptive +{faulty[-1]['total_s'] - free[-1]['total_s']:.1f}s (lost {faulty[-1]['lost_steps']})",
              flush=True)
    return {"steps": args.steps, "fault_free": free, "faulty": faulty}


def summarize(m: dict) -> dict:
    def per(policy: str, rows: list[dict], key: str) -> list[float]:
        return [r[key] for r in rows if r["policy"] == policy]

    never_free, adapt_free = per("never", m["fault_free"], "total_s"), per("adaptive", m["fault_free"], "total_s")
    overhead = [a / b - 1 for a, b in zip(adapt_free, never_free, strict=True)]
    cost = {p: [f - g for f, g in zip(per(p, m["faulty"], "total_s"), per(p, m["fault_free"], "total_s"), strict=True)]
            for p in ("never", "adaptive")}
    return {
        "failure_free_overhead_pct": 100 * statistics.fmean(overhead),
        "failure_free_overhead_pct_per_traj": [100 * o for o in overhead],
        "failure_cost_s": {p: statistics.fmean(c) for p, c in cost.items()},
        "recovery_speedup": statistics.fmean(cost["never"]) / max(statistics.fmean(cost["adaptive"]), 1e-9),
        "restore_latency_s": statistics.fmean(per("adaptive", m["faulty"], "recover_s")),
        "restart_latency_s": statistics.fmean(per("never", m["faulty"], "recover_s")),
        "lost_steps_mean": {p: statistics.fmean(per(p, m["faulty"], "lost_steps")) for p in ("never", "adaptive")},
        "checkpoints_per_traj": statistics.fmean(per("adaptive", m["fault_free"], "checkpoints")),
        "exec_s_mean": statistics.fmean(per("never", m["fault_free"], "exec_s_mean")),
        "measured_steps": m["steps"],
    }


def model(s: dict, *, steps: int, p_fail: float, n: int, seed: int) -> dict:
    """Monte Carlo at real think-time scale, with the measured per-step and recovery costs.

    (a) a failure restarts the trajectory: restart latency + every step so far again.
    (b) a failure costs the restore latency + the steps since the last ready checkpoint
    (at the measured checkpoint density); the adaptive policy's measured overhead is
    charged on every trajectory. Failures during regeneration are drawn too.
    """
    rng = np.random.default_rng(seed)
    interval = max(1.0, s["measured_steps"] / max(s["checkpoints_per_traj"], 1e-9))  # measured density
    totals = {"fault_free": [], "no_recovery": [], "belayer": []}
    recov = {"no_recovery": [], "belayer": []}
    for _ in range(n):
        step_s = rng.lognormal(np.log(THINK_MEDIAN_S), THINK_SIGMA, steps).clip(max=30) + s["exec_s_mean"]
        base = float(step_s.sum())
        totals["fault_free"].append(base)
        for name in ("no_recovery", "belayer"):
            t, k, ckpt = 0.0, 0, 0
            while k < steps:
                if rng.random() < p_fail:
                    partial = step_s[k] * rng.random()  # the failed step's work, lost
                    t += partial
                    if name == "no_recovery":
                        cost = partial + s["restart_latency_s"] + float(step_s[:k].sum())
                        k = 0
                    else:
                        cost = partial + s["restore_latency_s"] + float(step_s[ckpt:k].sum())
                        k = ckpt
                    recov[name].append(cost)
                    t += s["restart_latency_s"] if name == "no_recovery" else s["restore_latency_s"]
                    continue
                t += step_s[k]
                k += 1
                if name == "belayer" and k % round(interval) == 0:
                    ckpt = k
            if name == "belayer":  # measured overhead; a negative one is noise, not a gain
                t *= 1 + max(0.0, s["failure_free_overhead_pct"]) / 100
            totals[name].append(t)
    ff = statistics.fmean(totals["fault_free"])
    return {
        "steps": steps, "p_fail": p_fail, "trajectories": n, "checkpoint_interval_steps": interval,
        "mean_rollout_s": {k: statistics.fmean(v) for k, v in totals.items()},
        "rollout_vs_fault_free_pct": {k: 100 * (statistics.fmean(v) / ff - 1) for k, v in totals.items()},
        "recovery_cost_s": {k: statistics.fmean(v) if v else 0.0 for k, v in recov.items()},
        "recovery_speedup": (statistics.fmean(recov["no_recovery"]) / statistics.fmean(recov["belayer"])
                             if recov["belayer"] and recov["no_recovery"] else None),
    }


def plot(result: dict, path: Path) -> None:
    from _plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    s, mo = result["measured_summary"], result["modelled"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    names = ["fault_free", "no_recovery", "belayer"]
    ax[0].bar(names, [mo["rollout_vs_fault_free_pct"][n] for n in names], color=["grey", "tab:red", "tab:green"])
    ax[0].set_ylabel("rollout time vs fault-free (%)")
    ax[0].set_title(f"modelled: {mo['steps']} steps, p_fail={mo['p_fail']:.0%}/action")
    ax[1].bar(["(a) restart", "(b) Belayer"], [s["failure_cost_s"]["never"], s["failure_cost_s"]["adaptive"]],
              color=["tab:red", "tab:green"])
    ax[1].set_ylabel("measured cost of one failure (s)")
    ax[1].set_title(f"recovery speedup x{s['recovery_speedup']:.1f}")
    ax[2].bar(range(len(s["failure_free_overhead_pct_per_traj"])), s["failure_free_overhead_pct_per_traj"])
    ax[2].set_xticks(range(len(s["failure_free_overhead_pct_per_traj"])))
    ax[2].axhline(1.0, color="k", ls="--", lw=0.8)
    ax[2].set_xlabel("trajectory")
    ax[2].set_ylabel("adaptive overhead, fault-free (%)")
    ax[2].set_title(f"mean {s['failure_free_overhead_pct']:+.2f}% (target <= 1%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--think-scale", type=float, default=0.25,
                   help="scale of the real think time in measured runs (1.0: median 2 s)")
    p.add_argument("--model-steps", type=int, default=50)
    p.add_argument("--model-trajectories", type=int, default=20000)
    p.add_argument("--p-fail", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 trajectories of 8 steps")
    p.add_argument("--from-json", type=Path, help="re-model and re-plot the measurements of a result file")
    args = p.parse_args()
    if args.quick:
        args.trajectories, args.steps = 2, 8
    t0 = time.monotonic()
    measured = json.loads(args.from_json.read_text())["measured"] if args.from_json else measure(args)
    summary = summarize(measured)
    modelled = model(summary, steps=args.model_steps, p_fail=args.p_fail, n=args.model_trajectories, seed=args.seed)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "machine": {"platform": platform.platform(), "python": platform.python_version()},
              "think_time": {"dist": "lognormal", "median_s": THINK_MEDIAN_S, "sigma": THINK_SIGMA},
              "measured_summary": summary, "modelled": modelled, "measured": measured,
              "wall_s": time.monotonic() - t0}
    save_result(result, RESULTS / "env_recovery.json", plot)
    print(json.dumps({"measured_summary": {k: v for k, v in summary.items() if "per_traj" not in k},
                      "modelled": modelled}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
