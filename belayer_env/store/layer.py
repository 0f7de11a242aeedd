"""The container's writable file-system layer (overlay2 upperdir) as one tar file.

GNU tar in pax format keeps everything overlay needs to replay the layer on the same
lower layers: whiteouts (0:0 character devices), opaque directories and redirects
(``trusted.overlay.*`` xattrs), modes, numeric owners, symlinks, hardlinks and holes of
sparse files. Capture runs while the container is frozen, so it only streams bytes into
tmpfs; hashing and the durable copy happen after thaw. Install streams the file through
sha256 into ``tar -x`` and refuses the layer if the hash disagrees. Paths past PATH_MAX,
which GNU tar archives but cannot extract, are made through directory fds (``long_paths``).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import IO, Any

from belayer_env.store import long_paths
from belayer_env.store.manifest import CHUNK, check_file

TAR_OPTS = ["--format=posix", "--xattrs", "--xattrs-include=*", "--numeric-owner"]


class LayerError(Exception):
    """The layer could not be captured or installed (message says why)."""


class LayerTooLarge(LayerError):
    """The layer's tar grew past the capture limit (``CheckpointStore.max_layer_bytes``)."""


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
    ``max_bytes`` bounds the tar file (its RLIMIT_FSIZE, through util-linux ``prlimit``):
    the capture space is bounded even if the layer grew after it was measured.
    """

    def __init__(self, upper: Path, dest: Path, max_bytes: int | None = None):
        self.upper, self.dest, self.max_bytes = upper, dest, max_bytes
        argv = ["tar", "--create", "--sparse", f"--file={dest}", f"--directory={upper}", *TAR_OPTS, "."]
        if max_bytes is not None and shutil.which("prlimit"):
            argv = ["prlimit", f"--fsize={max_bytes}:{max_bytes}", "--", *argv]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait(self) -> None:
        _, err = self._proc.communicate()
        if self.max_bytes is not None and self._proc.returncode != 0 and _size(self.dest) >= self.max_bytes:
            raise LayerTooLarge(f"the writable layer is larger than the checkpoint limit of {self.max_bytes} bytes "
                                "(CheckpointStore.max_layer_bytes, $BELAYER_MAX_LAYER_BYTES)")
        if self._proc.returncode == 1:  # GNU tar: "file changed as we read it"
            raise LayerChanged(f"{self.upper} changed while tar read it: {err.decode(errors='replace').strip()[-300:]}")
        if self._proc.returncode != 0:
            raise LayerError(f"tar of {self.upper} failed ({self._proc.returncode}): "
                             f"{err.decode(errors='replace').strip()[-500:]}")

    def abort(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


def stream_tar(argv: list[str], fo: Any, max_bytes: int | None, what: str) -> tuple[int, str]:
    """Run ``tar`` (``argv`` writes the archive to stdout) into ``fo``, hashing on the way:
    the checkpoint's layer.tar and its digest in one pass; ``LayerTooLarge`` past ``max_bytes``."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    h, size = hashlib.sha256(), 0
    try:
        while chunk := proc.stdout.read(CHUNK):
            h.update(chunk)
            fo.write(chunk)
            size += len(chunk)
            if max_bytes is not None and size > max_bytes:
                raise LayerTooLarge(f"the writable layer is larger than the checkpoint limit of {max_bytes} bytes "
                                    "(CheckpointStore.max_layer_bytes, $BELAYER_MAX_LAYER_BYTES)")
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if proc.wait() != 0:
            raise LayerError(f"tar of {what} failed: {err.strip()[-500:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return size, h.hexdigest()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


EXTRACT = ["tar", "--extract", "--quoting-style=escape", *TAR_OPTS, "--same-permissions", "--same-owner"]
"""GNU tar as every layer is unpacked (one error per line: ``long_paths.only_too_long``)."""


def copy_tree(src: Path, dest: Path) -> None:
    """Copy a layer tree into ``dest`` (another file system: a sandbox's capped layer), keeping
    what overlay needs (whiteouts, xattrs, owners, holes); paths past PATH_MAX included."""
    pack_argv = ["tar", "--create", "--sparse", "--file=-", f"--directory={src}", *TAR_OPTS, "."]
    pack = subprocess.Popen(pack_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    unpack = subprocess.run([*EXTRACT, "--file=-", f"--directory={dest}"], stdin=pack.stdout, capture_output=True)
    assert pack.stdout is not None
    pack.stdout.close()
    err = pack.stderr.read().decode(errors="replace") if pack.stderr else ""
    unpack_err = unpack.stderr.decode(errors="replace")
    if pack.wait() != 0 or (unpack.returncode != 0 and not long_paths.only_too_long(unpack_err)):
        raise LayerError(f"copying {src} to {dest} failed: {(err + unpack_err).strip()[-500:]}")
    if unpack.returncode != 0:  # only names too long for tar: made again, through directory fds
        again = subprocess.Popen(pack_argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert again.stdout is not None
        try:
            long_paths.extract_long(again.stdout, dest)
        except (OSError, tarfile.TarError) as e:
            raise LayerError(f"copying the long paths of {src} to {dest} failed: {e}") from e
        finally:
            again.stdout.close()
            again.wait()


def extract(archive: Path, dest: Path, what: str) -> None:
    """Unpack ``archive`` into ``dest`` (which may hold a tree already), long paths included."""
    proc = subprocess.run([*EXTRACT, f"--file={archive}", f"--directory={dest}"], capture_output=True)
    _finish(proc.returncode, proc.stderr.decode(errors="replace"), archive, dest, what)


def _finish(returncode: int, err: str, archive: Path | IO[bytes], dest: Path, what: str) -> None:
    if returncode == 0:
        return
    if not long_paths.only_too_long(err):
        raise LayerError(f"{what} failed: {err.strip()[-500:]}")
    try:  # GNU tar failed only on names past PATH_MAX: those are made through directory fds
        if isinstance(archive, Path):
            with open(archive, "rb") as f:
                long_paths.extract_long(f, dest)
        else:
            archive.seek(0)
            long_paths.extract_long(archive, dest)
    except (OSError, tarfile.TarError) as e:
        raise LayerError(f"{what} failed on a path past PATH_MAX: {e}") from e


def install(src: Path, upper: Path, meta: dict[str, Any]) -> None:
    """Unpack layer ``src`` into an empty upperdir, verifying size + sha256 on the way."""
    h = hashlib.sha256()
    size = 0
    with open(src, "rb") as f, tempfile.TemporaryFile() as errf:  # stderr to a file: a pipe could fill
        proc = subprocess.Popen([*EXTRACT, "--file=-", f"--directory={upper}"], stdin=subprocess.PIPE, stderr=errf)
        assert proc.stdin is not None
        try:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
                proc.stdin.write(chunk)
            proc.stdin.close()
        except (OSError, BrokenPipeError) as e:
            proc.kill()
            proc.wait()
            raise LayerError(f"installing {src.name} failed: {e}") from e
        returncode = proc.wait()
        errf.seek(0)
        err = errf.read().decode(errors="replace")
        if returncode != 0 and not long_paths.only_too_long(err):
            raise LayerError(f"tar -x of {src.name} failed: {err.strip()[-500:]}")
        try:
            check_file(src.name, meta, size, h.hexdigest())
        except ValueError as e:
            raise LayerError(str(e)) from e
        _finish(returncode, err, f, upper, f"tar -x of {src.name}")  # the same open file: the bytes hashed
