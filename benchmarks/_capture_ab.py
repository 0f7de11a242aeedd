"""Two ways of capturing one sandbox, side by side: the rounds and the plot every capture A/B
benchmark shares (``scratch_ab.py``, ``conntrack_ab.py``).

Each round runs an agent-like step, then one incremental capture per variant, in alternating
order (the load is shared); before each, the variant's ``prepare`` runs (outside the timed
capture). The first capture into each store (everything copied) is not measured.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from _plotting import plot_pairs
from checkpoint_bench import STEP, bench_sandbox, settle, summarize

from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.store.manifest import read_manifest
from belayer_env.store.store import CheckpointStore

METRICS = ("frozen_s", "criu_memdump_s", "criu_frozen_s")


def parse_args(doc: str, name: str, out_help: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    """The options every capture A/B takes (``extra`` adds its own); exits 2 unless root."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra is not None:
        extra(ap)
    ap.add_argument("--runs", type=int, default=10, help="rounds per scenario (one capture per variant each)")
    ap.add_argument("--scenarios", default="idle,heavy")
    ap.add_argument("--out", help=out_help)
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    if os.geteuid() != 0:
        print(f"{name}: needs root (Docker, runc, CRIU, the knob it flips)", file=sys.stderr)
        raise SystemExit(2)
    return args


@dataclass
class Variant:
    store: CheckpointStore
    prepare: Callable[[], None] = lambda: None


def run_rounds(client, scenario: str, runs: int, variants: dict[str, Variant], run_id: str) -> dict:
    """Raw samples: ``{variant: {metric: [seconds, ...]}}``, one per round."""
    sb = bench_sandbox(client, scenario, run_id)
    raw = {v: {m: [] for m in METRICS} for v in variants}
    names = list(variants)
    try:
        for variant in variants.values():
            variant.prepare()
            full_checkpoint(sb, variant.store)  # the store's first capture: everything copied, not measured
        for i in range(runs):
            sb.execute(STEP.format(i=i))
            for name in names if i % 2 == 0 else names[::-1]:
                variants[name].prepare()
                settle()
                ck = full_checkpoint(sb, variants[name].store)
                detail = read_manifest(ck.path).get("frozen_detail") or {}
                raw[name]["frozen_s"].append(ck.frozen_s)
                for m in METRICS[1:]:
                    raw[name][m].append(detail.get(m, 0.0))
            print(f"  {scenario} round {i + 1}/{runs}: " + ", ".join(
                f"{v} {raw[v]['frozen_s'][-1] * 1e3:.0f} ms" for v in names), flush=True)
    finally:
        sb.close()
    return raw


def summarize_ab(raw: dict, baseline: str, candidate: str) -> dict:
    """p50/p90 per variant and metric, and the candidate's p50 over the baseline's."""
    data = {v: {m: summarize(samples) for m, samples in metrics.items()} for v, metrics in raw.items()}
    for m, key in zip(METRICS, ("frozen", "memdump", "criu_frozen"), strict=True):
        data[f"ratio_{key}_p50"] = data[candidate][m]["p50"] / max(data[baseline][m]["p50"], 1e-9)
    data["raw"] = raw
    return data


def print_ab(result: dict, baseline: str, candidate: str) -> None:
    for scen, data in result["scenarios"].items():
        print(f"{scen}: " + "; ".join(
            f"{v}: frozen p50 {data[v]['frozen_s']['p50'] * 1e3:.1f} ms p90 {data[v]['frozen_s']['p90'] * 1e3:.1f}, "
            f"memdump p50 {data[v]['criu_memdump_s']['p50'] * 1e3:.1f} ms" for v in (baseline, candidate))
            + f"; {candidate}/{baseline} frozen {data['ratio_frozen_p50']:.2f}x")


def plot_ab(result: dict, path: Path, variants: tuple[str, str], label: str) -> None:
    """Bars per metric (p50, whisker to p90), one pair per scenario; ``label`` names the knob."""
    plot_pairs(result, path, variants, label, METRICS, list(METRICS),
               lambda scen, data: f"{scen}: frozen {data['ratio_frozen_p50']:.2f}x, "
                                  f"CRIU frozen {data['ratio_criu_frozen_p50']:.2f}x")
