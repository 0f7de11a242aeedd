"""Ray is optional: the core of belayer_env imports and runs without it."""

from __future__ import annotations

import subprocess
import sys

CORE = ("belayer_env", "belayer_env.env.recoverable", "belayer_env.capture.checkpoint", "belayer_env.restore.restore", "belayer_env.env.resumable",
        "belayer_env.store.replica", "belayer_env.registration")


def test_core_never_imports_ray():
    code = ("import importlib, sys\n"
            f"for m in {CORE!r}: importlib.import_module(m)\n"
            "import gymnasium as gym; gym.make('belayer/Sandbox-v0').unwrapped.close()\n"
            "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the core imported ray (or failed):\n{done.stderr[-2000:]}"


def test_core_imports_with_ray_unavailable():
    # a None entry in sys.modules makes `import ray` raise ImportError: Ray not installed
    code = ("import sys; sys.modules['ray'] = None\n"
            f"import importlib\nfor m in {CORE!r}: importlib.import_module(m)\n"
            "try:\n    import belayer_env.ray\nexcept Exception as e:\n"
            "    assert type(e).__name__ == 'UsageError' and \"belayer[ray]\" in str(e), e\n"
            "else:\n    raise AssertionError('belayer_env.ray imported without ray')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
