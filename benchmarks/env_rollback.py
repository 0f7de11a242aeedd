"""Env rollback latency: detection of a dead sandbox to the rolled-back env, standby off vs on.

What an agent waits for after an infrastructure failure, end to end through
``RecoverableSandboxEnv`` (fence, the pre-staged restore or the standby's promotion,
trajectory rollback), not one restore call. Per round: an action, a checkpoint of that
boundary (``always`` policy), ``settle``; with ``--when prestaged`` (default) the round waits
until the checkpoint is pre-staged (and, standby on, until the standby is ready), with
``--when published`` it fails right after publication (a rollback then waits for a
pre-staging in flight). The container is SIGKILLed from outside (the failure, untimed) and
the next step rolls back; ``recovery_s`` is what the env records for that rollback. Both
modes alternate per round on the same sandbox kind (``idle`` or ``heavy``, as in
checkpoint_bench.py), so the load is shared.

    python3 benchmarks/env_rollback.py --runs 5 --scenario heavy
Writes benchmarks/results/env_rollback.json and .png (matplotlib); Docker + CRIU, root.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plotting import pyplot, save_result  # noqa: E402
from checkpoint_bench import HEAVY_SETUP  # noqa: E402

from belayer_env.env.recoverable import EnvConfig, RecoverableSandboxEnv  # noqa: E402
from belayer_env.restore.prestaging import staged_copies  # noqa: E402
from belayer_env.sandbox.docker_api import connect  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WAIT_S = 120.0


def _wait(what: str, ready) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {WAIT_S:g} s")
        time.sleep(0.05)


def one_rollback(env: RecoverableSandboxEnv, client, i: int, standby: bool, when: str) -> float:
    env.step(f"echo {i} >> /tmp/steps")
    env.settle()
    if when == "prestaged":
        newest = env.checkpointer.ready[-1].id
        if standby:  # the standby's restore claims the pre-staged copy
            _wait("standby", lambda: env.checkpointer.standby is not None and env.checkpointer.standby.ready())
        else:
            _wait("pre-staged copy", lambda: any(newest in d.name for d in staged_copies(client, env.name)))
    client.api.kill(env.sandbox.container_id)  # the failure (untimed)
    _, _, _, _, info = env.step("true")
    if "rollback" not in info["belayer"]:
        raise RuntimeError(f"round {i}: no rollback after the kill: {info}")
    return [e for e in env.trajectory.events if getattr(e, "recovery_s", None) is not None][-1].recovery_s


def run(args: argparse.Namespace) -> dict:
    client = connect()
    envs = {mode: RecoverableSandboxEnv(EnvConfig(standby=mode == "standby"), client=client,
                                        checkpoint_policy="always") for mode in ("restore", "standby")}
    out: dict = {mode: [] for mode in envs}
    loads = []
    try:
        for env in envs.values():
            env.reset()
            if args.scenario == "heavy":
                r = env.sandbox.execute(HEAVY_SETUP)
                assert r["returncode"] == 0, r["output"][-2000:]
        for i in range(args.runs):
            order = list(envs) if i % 2 == 0 else list(envs)[::-1]
            for mode in order:
                out[mode].append(one_rollback(envs[mode], client, i, mode == "standby", args.when))
            loads.append(os.getloadavg())
            print(f"  round {i + 1}/{args.runs}: " + ", ".join(f"{m} {out[m][-1] * 1e3:.0f} ms" for m in envs)
                  + f", load {loads[-1][0]:.1f}", flush=True)
    finally:
        for env in envs.values():
            env.close()
    summary = {m: {"p50_s": statistics.median(v), "p90_s": sorted(v)[int(0.9 * (len(v) - 1))], "all_s": v}
               for m, v in out.items()}
    return {"scenario": args.scenario, "when": args.when, "runs": args.runs, "rollback": summary,
            "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "loadavg": loads}}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    modes = list(result["rollback"])
    ax.boxplot([[x * 1e3 for x in result["rollback"][m]["all_s"]] for m in modes])
    ax.set_xticks(range(1, len(modes) + 1), modes)
    ax.set_yscale("log")
    ax.set_ylabel("detection -> rolled back (ms)")
    ax.set_title(f"env rollback, {result['scenario']} sandbox ({result['when']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--scenario", choices=("idle", "heavy"), default="heavy")
    p.add_argument("--when", choices=("prestaged", "published"), default="prestaged",
                   help="fail once the checkpoint is pre-staged (and the standby ready), or right at publication")
    p.add_argument("--out", type=Path, default=RESULTS / "env_rollback.json")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be >= 1")
    result = run(args)
    save_result(result, args.out, plot)
    for mode, s in result["rollback"].items():
        print(f"{mode:8s} p50 {s['p50_s'] * 1e3:7.0f} ms  p90 {s['p90_s'] * 1e3:7.0f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
