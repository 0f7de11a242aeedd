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

