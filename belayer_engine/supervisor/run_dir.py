"""The engine's run directory: logs and control and weight sockets, private to its user."""

from __future__ import annotations

from pathlib import Path

from belayer_core.errors import UsageError


def private_run_dir(path: Path) -> Path:
    """Create ``path`` 0700 (logs, control and weight sockets live there); refuse an existing
    one that other users may write to, where a socket could be swapped under the engine."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o022:
        raise UsageError(f"run_dir {path} is writable by group or others (mode "
                         f"{path.stat().st_mode & 0o777:o}); use a private directory (chmod 700)")
    return path
