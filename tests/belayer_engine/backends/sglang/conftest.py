"""Real SGLang servers behind the engine. One engine per module: a server takes about a
minute to start on a loaded 2-core machine.

SGLang lives in its own venv (``scripts/setup_sglang.sh``, run by ``scripts/setup.sh``):
a missing venv fails these tests, never skips them (the README's test command installs it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from belayer_engine.backends.sglang.launcher import DEFAULT_VENV, SETUP_HINT


def sglang_venv() -> str:
    venv = os.environ.get("BELAYER_SGLANG_VENV") or DEFAULT_VENV
    if (Path(venv) / "bin" / "python").is_file():
        return venv
    pytest.fail(f"SGLang is not installed at {venv}: {SETUP_HINT}")
