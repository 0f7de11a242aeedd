"""Ray is optional: the engine's core imports without it."""

from __future__ import annotations

import subprocess
import sys

CORE = ("belayer_engine", "belayer_engine.engine", "belayer_engine.router", "belayer_engine.supervisor")


def test_engine_core_never_imports_ray():
    code = ("import importlib, sys\n"
            f"for m in {CORE!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "assert not bad, bad\n"
            "sys.modules['ray'] = None\n"
            "try:\n    import belayer_engine.ray\nexcept Exception as e:\n"
            "    assert type(e).__name__ == 'UsageError' and \"belayer[ray]\" in str(e), e\n"
            "else:\n    raise AssertionError('belayer_engine.ray imported without ray')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the engine core imported ray (or failed):\n{done.stderr[-2000:]}"
