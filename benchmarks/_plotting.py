"""The one way benchmarks get a headless pyplot and save their result: matplotlib is optional
(``belayer[plot]``), so without it a benchmark still writes its JSON and says why there is no plot."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (with a message) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install 'belayer[plot]'): no plot", file=sys.stderr)
        return None
    return plt


def save_result(result: dict, json_path: str | Path, plot: Callable[[dict, Path], object] | None = None) -> Path:
    """Write ``result`` as JSON at ``json_path`` (making its folder) and, given ``plot``, its plot
    beside it under the same name with ``.png``: every benchmark ends with both."""
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    if plot is not None:
        plot(result, path.with_suffix(".png"))
    return path


def plot_pairs(result: dict, path: Path, variants: tuple[str, str], label: str, metrics: tuple[str, ...],
               ticks: list[str], title: Callable[[str, dict], str]) -> None:
    """An A/B's bars: per scenario, per metric (seconds in ``result["scenarios"][scen][variant]``)
    one bar per variant at its p50 with a whisker to its p90; ``label`` names the knob."""
    plt = pyplot()
    if plt is None:
        return
    scenarios = list(result["scenarios"])
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 4.2), squeeze=False)
    for ax, scen in zip(axes[0], scenarios, strict=True):
        data = result["scenarios"][scen]
        w = 0.38
        for j, variant in enumerate(variants):
            p50 = [data[variant][m]["p50"] * 1e3 for m in metrics]
            p90 = [data[variant][m]["p90"] * 1e3 for m in metrics]
            ax.bar([k + j * w for k in range(len(metrics))], p50, width=w, label=f"{label}: {variant}",
                   yerr=[[0] * len(p50), [max(b - a, 0) for a, b in zip(p50, p90, strict=True)]], capsize=2)
        ax.set_xticks([k + w / 2 for k in range(len(metrics))], ticks)
        ax.set_title(title(scen, data))
        ax.set_ylabel("ms (bar p50, whisker p90)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
