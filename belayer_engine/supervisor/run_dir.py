"""The engine's run directory: logs and control and weight sockets, private to its user.

A temporary one (no ``run_dir`` given) names its engine in an ``owner`` file, so that
``belayer gc`` removes it once that engine is gone without its own clean-up (SIGKILL,
SIGTERM, an ``os._exit``): nothing else would.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from belayer_core.errors import UsageError
from belayer_core.procfs import OwnerId, owner_alive

TEMP_PREFIX = "belayer-engine-"
OWNER_FILE = "owner"


def private_run_dir(path: Path) -> Path:
    """Create ``path`` 0700 (logs, control and weight sockets live there); refuse an existing
    one that other users may write to, where a socket could be swapped under the engine."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o022:
        raise UsageError(f"run_dir {path} is writable by group or others (mode "
                         f"{path.stat().st_mode & 0o777:o}); use a private directory (chmod 700)")
    return path


def temp_run_dir() -> tempfile.TemporaryDirectory:
    """A 0700 temporary run dir that names this process as its owner."""
    tmp = tempfile.TemporaryDirectory(prefix=TEMP_PREFIX)
    staged = Path(tmp.name) / f".{OWNER_FILE}"
    staged.write_text(OwnerId.current().to_label())
    staged.rename(staged.with_name(OWNER_FILE))  # whole or absent: gc never reads half a label
    return tmp


def orphaned(tmp_dir: str | None = None) -> list[Path]:
    """Temporary run dirs of this user whose owner file names an engine that is gone.

    Only real directories owned by this user, never followed through a link; a dir without
    an owner file (not one of ours, or still being created) is left alone."""
    found = []
    for path in sorted(Path(tmp_dir or tempfile.gettempdir()).glob(TEMP_PREFIX + "*")):
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            owner_file = path / OWNER_FILE
            if not stat.S_ISREG(owner_file.lstat().st_mode):
                continue
            label = owner_file.read_text()[:100].strip()
        except OSError:
            continue
        if not owner_alive(label):
            found.append(path)
    return found


def reap_orphans(tmp_dir: str | None = None) -> list[str]:
    """Remove every ``orphaned`` run dir; the paths removed."""
    removed = []
    for path in orphaned(tmp_dir):
        shutil.rmtree(path, ignore_errors=True)  # never follows links inside
        if not path.exists():
            removed.append(str(path))
    return removed
