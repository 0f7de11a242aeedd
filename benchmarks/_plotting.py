"""The one way benchmarks get a headless pyplot: matplotlib is optional (``belayer[plot]``),
so without it a benchmark still writes its JSON and says why there is no plot."""

from __future__ import annotations

import sys


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
