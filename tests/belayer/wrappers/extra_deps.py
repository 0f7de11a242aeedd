"""Trainer and agent packages the wrapper tests run against, installed by set-up beside the
project's environment (never core dependencies). A missing one makes its tests fail with
the set-up command, never skip."""

from __future__ import annotations

import os
import sys
from pathlib import Path

MINISWEAGENT_VENV_DEFAULT = "/opt/belayer/minisweagent-venv"
MINISWEAGENT_HINT = ("run `bash scripts/setup_minisweagent.sh` (part of `bash scripts/setup.sh`; "
                     "or set BELAYER_MINISWEAGENT_VENV to its venv)")


def minisweagent_venv() -> Path:
    return Path(os.environ.get("BELAYER_MINISWEAGENT_VENV") or MINISWEAGENT_VENV_DEFAULT)


def add_minisweagent_venv() -> str | None:
    """Put mini-swe-agent's venv's site-packages *after* this interpreter's own entries, so
    ``import minisweagent`` works here. scripts/setup_minisweagent.sh resolved that venv
    holding every package of the project's environment at its installed version: it only
    adds packages, so appending it shadows nothing the project imports. Returns None when
    mini-swe-agent is importable, else why not (with the set-up hint)."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # its import prints a banner otherwise
    venv = minisweagent_venv()
    lib = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if lib.is_dir() and str(lib) not in sys.path:
        os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(venv / "mswea-config"))
        sys.path.append(str(lib))
    try:
        import minisweagent  # noqa: F401
    except ImportError as e:
        return f"mini-swe-agent is not importable ({e}; looked in {lib}): {MINISWEAGENT_HINT}"
    return None
