"""The container's writable file-system layer (overlay2 upperdir) as one tar file.

GNU tar in pax format keeps everything overlay needs to replay the layer on the same
lower layers: whiteouts (0:0 character devices), opaque directories and redirects
(``trusted.overlay.*`` xattrs), modes, numeric owners, symlinks, hardlinks and holes of
sparse files. Capture runs while the container is frozen, so it only streams bytes into
tmpfs; hashing and the durable copy happen after thaw. Install streams the file through
sha256 into ``tar -x`` and refuses the layer if the hash disagrees.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

from belayer_env.checkpoint.manifest import CHUNK, check_file

TAR_OPTS = ["--format=posix", "--xattrs", "--xattrs-include=*", "--numeric-owner"]


class LayerError(Exception):
    """The layer could not be captured or installed (message says why)."""


class LayerChanged(LayerError):
    """The upperdir changed during the tar (CRIU's dump briefly makes a temp dir in /tmp)."""


def upper_dir(inspect: dict[str, Any]) -> Path:
    """The overlay upperdir from ``docker inspect``; only overlay2 is supported."""
    driver = inspect.get("GraphDriver", {})
    upper = driver.get("Data", {}).get("UpperDir")
    if driver.get("Name") != "overlay2" or not upper:
        raise LayerError(f"storage driver {driver.get('Name')!r} is not overlay2: cannot capture the layer")
    return Path(upper)


class Capture:
    """``tar`` of the upperdir running in the background (started once frozen).

    It runs alongside the CRIU dump, so the freeze lasts max(dump, tar), not the sum.
    """

    def __init__(self, upper: Path, dest: Path):
        self.upper = upper
        self._proc = subprocess.Popen(
            ["tar", "--create", "--sparse", f"--file={dest}", f"--directory={upper}", *TAR_OPTS, "."],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait(self) -> None:
        _, err = self._proc.communicate()
        if self._proc.returncode == 1:  # GNU tar: "file changed as we read it"
            raise LayerChanged(f"{self.upper} changed while tar read it: {err.decode(errors='replace').strip()[-300:]}")
        if self._proc.returncode != 0:
            raise LayerError(f"tar of {self.upper} failed ({self._proc.returncode}): "
                             f"{err.decode(errors='replace').strip()[-500:]}")

    def abort(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


def install(src: Path, upper: Path, meta: dict[str, Any]) -> None:
    """Unpack layer ``src`` into an empty upperdir, verifying size + sha256 on the way."""
    h = hashlib.sha256()
    size = 0
    proc = subprocess.Popen(["tar", "--extract", "--file=-", f"--directory={upper}", *TAR_OPTS,
                             "--same-permissions", "--same-owner"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        with open(src, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
                proc.stdin.write(chunk)
        proc.stdin.close()
    except (OSError, BrokenPipeError) as e:
        proc.kill()
        proc.wait()
        raise LayerError(f"installing {src.name} failed: {e}") from e
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.wait() != 0:
        raise LayerError(f"tar -x of {src.name} failed: {err.strip()[-500:]}")
    try:
        check_file(src.name, meta, size, h.hexdigest())
    except ValueError as e:
        raise LayerError(str(e)) from e
