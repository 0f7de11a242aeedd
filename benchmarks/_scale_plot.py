"""The plot of ``handover_at_scale.py``: kill -> next token (p50 bar, max tick) per cell and mode."""

from __future__ import annotations

import re
from pathlib import Path


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    modes = [m for m, v in result["modes"].items() if v.get("cells")]
    cells = sorted({c for m in modes for c in result["modes"][m]["cells"]},
                   key=lambda c: tuple(int(v) for v in re.findall(r"\d+", c)))  # "8192x16@16-2": a repeated kill point
    if not modes or not cells:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cells) * len(modes) / 2), 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs, p50, top = [], [], []
        for j, cell in enumerate(cells):
            stats = result["modes"][mode]["cells"].get(cell, {}).get("next_token_s", {})
            if stats.get("n"):
                xs.append(j + i * width)
                p50.append(1e3 * stats["p50"])
                top.append(1e3 * stats["max"])
        ax.bar(xs, p50, width, label=f"{mode} (p50)")
        ax.scatter(xs, top, marker="_", s=200, color="black")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))])
    ax.set_xticklabels([c.replace("x", " tok x ").replace("@", " req, kill at ") + ("" if "@" in c else " req") for c in cells], rotation=20, fontsize=8)
    ax.set_ylabel("kill -> next token at the client (ms); tick: max")
    args = result["args"]
    tokens = (result.get("pool") or {}).get("kv_tokens") or 0
    ax.set_title(f"{args['device']} {result['machine'].get('gpu') or ''} KV pool {tokens:,} tokens",
                 fontsize=9)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
