"""Frozen time with the capture scratch on a plain tmpfs vs the large-folio one, side by side.

CRIU writes the sandbox's memory into the scratch while the sandbox is frozen
(``belayer_env/checkpoint/scratch.py``). One sandbox (``idle`` or ``heavy``, as in
checkpoint_bench.py), two stores: ``plain`` has its scratch in a directory of /dev/shm
(what every capture used before), ``large`` the default root, mounted with
``huge=within_size``. Each round runs an agent-like step, then one incremental capture into
each store, in alternating order (the load is shared); the first capture of each store
(everything copied) is not measured.

    python3 benchmarks/scratch_ab.py --runs 10 --scenarios idle,heavy
Writes benchmarks/results/scratch_ab.json and .png; Docker + CRIU, root.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plotting import pyplot, save_result  # noqa: E402
from checkpoint_bench import STEP, bench_sandbox, settle, summarize  # noqa: E402

from belayer_env.checkpoint import full_checkpoint, scratch  # noqa: E402
from belayer_env.checkpoint.manifest import read_manifest  # noqa: E402
from belayer_env.checkpoint.store import CheckpointStore  # noqa: E402
from belayer_env.docker_api import connect  # noqa: E402

VARIANTS = ("plain", "large")
METRICS = ("frozen_s", "criu_memdump_s", "criu_frozen_s")


def run(client, scenario: str, runs: int, stores: dict[str, CheckpointStore], run_id: str) -> dict:
    sb = bench_sandbox(client, scenario, run_id)
    raw = {v: {m: [] for m in METRICS} for v in VARIANTS}
    try:
        for store in stores.values():
            full_checkpoint(sb, store)  # each store's first capture: everything copied, not measured
        for i in range(runs):
            sb.execute(STEP.format(i=i))
            for variant in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                settle()
                ck = full_checkpoint(sb, stores[variant])
                detail = read_manifest(ck.path).get("frozen_detail") or {}
                raw[variant]["frozen_s"].append(ck.frozen_s)
                for m in METRICS[1:]:
                    raw[variant][m].append(detail.get(m, 0.0))
            print(f"  {scenario} round {i + 1}/{runs}: " + ", ".join(
                f"{v} {raw[v]['frozen_s'][-1] * 1e3:.0f} ms" for v in VARIANTS), flush=True)
    finally:
        sb.close()
    return raw


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    scenarios = list(result["scenarios"])
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 4.2), squeeze=False)
    for ax, scen in zip(axes[0], scenarios, strict=True):
        data = result["scenarios"][scen]
        w = 0.38
        for j, variant in enumerate(VARIANTS):
            p50 = [data[variant][m]["p50"] * 1e3 for m in METRICS]
            p90 = [data[variant][m]["p90"] * 1e3 for m in METRICS]
            ax.bar([k + j * w for k in range(len(METRICS))], p50, width=w, label=f"scratch: {variant}",
                   yerr=[[0] * len(p50), [max(b - a, 0) for a, b in zip(p50, p90, strict=True)]], capsize=2)
        ax.set_xticks([k + w / 2 for k in range(len(METRICS))], METRICS)
        ax.set_title(f"{scen}: frozen {data['ratio_frozen_p50']:.2f}x, memdump {data['ratio_memdump_p50']:.2f}x")
        ax.set_ylabel("ms (bar p50, whisker p90)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="rounds per scenario (one capture per variant each)")
    ap.add_argument("--scenarios", default="idle,heavy")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "scratch_ab.json"))
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    if os.geteuid() != 0:
        print("scratch_ab: needs root (Docker, runc, CRIU, the scratch mount)", file=sys.stderr)
        return 2
    client = connect()
    run_id = uuid.uuid4().hex[:8]
    work = Path(tempfile.mkdtemp(prefix="belayer-scratch-ab-", dir="/var/tmp"))
    plain_base = Path(tempfile.mkdtemp(prefix="belayer-scratch-ab-", dir="/dev/shm"))
    stores = {"plain": CheckpointStore(work / "plain", keep=2, scratch=plain_base),
              "large": CheckpointStore(work / "large", keep=2)}
    large_options = scratch.mount_options(stores["large"].scratch_root)
    result = {"host": {"kernel": platform.release(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                       "run_id": run_id},
              "scratch": {"plain": str(stores["plain"].scratch_root),
                          "large": f"{stores['large'].scratch_root} ({large_options or 'NOT the large-folio tmpfs'})"},
              "runs": args.runs, "scenarios": {}}
    if large_options is None:
        print("warning: the default scratch root is not the large-folio tmpfs here; both variants are plain",
              file=sys.stderr)
    try:
        for scen in args.scenarios.split(","):
            raw = run(client, scen, args.runs, stores, run_id)
            data = {v: {m: summarize(raw[v][m]) for m in METRICS} for v in VARIANTS}
            data["ratio_frozen_p50"] = data["large"]["frozen_s"]["p50"] / data["plain"]["frozen_s"]["p50"]
            data["ratio_memdump_p50"] = (data["large"]["criu_memdump_s"]["p50"]
                                         / max(data["plain"]["criu_memdump_s"]["p50"], 1e-9))
            data["raw"] = raw
            result["scenarios"][scen] = data
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(plain_base, ignore_errors=True)
    result["host"]["loadavg_end"] = os.getloadavg()
    out = save_result(result, args.out, plot)
    for scen, data in result["scenarios"].items():
        print(f"{scen}: " + "; ".join(
            f"{v}: frozen p50 {data[v]['frozen_s']['p50'] * 1e3:.1f} ms p90 {data[v]['frozen_s']['p90'] * 1e3:.1f}, "
            f"memdump p50 {data[v]['criu_memdump_s']['p50'] * 1e3:.1f} ms" for v in VARIANTS)
            + f"; large/plain frozen {data['ratio_frozen_p50']:.2f}x")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
