"""A per-sandbox disk cap: the container's writable layer on a file system of its own size.

Docker's ``--storage-opt size`` needs overlay2 on xfs with project quotas; this engine's
overlay2 sits on ext4 without them. So, between ``create`` and ``start``, the layer's
directory (``/var/lib/docker/overlay2/<id>``: upperdir ``diff``, ``work`` and Docker's
``link``/``lower`` files) is replaced by an ext4 file system in a sparse file of the
cap's size, loop-mounted over it: upperdir and workdir stay on one mount, as overlayfs
requires, and a write past the cap fails inside the sandbox with ENOSPC. The sparse file
is unlinked once mounted, so the host spends only what the sandbox writes, and nothing is
left behind: Docker's removal of the layer unmounts it, and the loop device detaches itself
at that unmount (autoclear; ``mounting.loop_mount``: the system calls, not ``mount(8)``).
CRIU is unaffected (it sees the same overlay root); a restore copies the checkpoint's layer
into the new file system (``layer.copy_tree``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

from belayer_core.errors import ConfigError, SandboxLost
from belayer_core.procfs import OwnerId
from belayer_core.procfs import owner_alive as _label_owner_alive
from belayer_env.sandbox import mounting

TOOL_TIMEOUT_S = 60.0
IMAGE_PREFIX = "belayer-disk-"
MKFS_OPTS = ["-q", "-F", "-t", "ext4", "-m", "0", "-i", "8192", "-O", "^has_journal",
             "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"]
"""No journal (the layer dies with its container anyway), no root reserve (the cap is what
the sandbox gets), one inode per 8 KiB (source trees are many small files)."""


def layer_dir(inspect: dict[str, Any]) -> Path:
    """The directory of the container's own overlay2 layer (parent of its upperdir)."""
    driver = inspect.get("GraphDriver") or {}
    upper = (driver.get("Data") or {}).get("UpperDir")
    if driver.get("Name") != "overlay2" or not upper:
        raise ConfigError(f"a disk limit needs Docker's overlay2 storage driver, not {driver.get('Name')!r}; "
                          "pass disk=None to run without one")
    return Path(upper).parent


def unsupported(directory: Path) -> str | None:
    """Why the cap cannot be applied here, or None."""
    if os.geteuid() != 0:
        return "it mounts a file system, which needs root"
    if not directory.is_dir():
        return f"the container's layer {directory} is not on this machine (a remote Docker daemon?)"
    if not shutil.which("mkfs.ext4"):
        return "mkfs.ext4 is not installed (apt-get install e2fsprogs)"
    if not os.path.exists(mounting.LOOP_CONTROL):
        return f"this host has no loop devices ({mounting.LOOP_CONTROL}: modprobe loop)"
    return None


def limit_layer(inspect: dict[str, Any], size_bytes: int) -> None:
    """Put the (created, not started) container's writable layer on a ``size_bytes`` file system."""
    directory = layer_dir(inspect)
    if why := unsupported(directory):
        raise ConfigError(f"cannot apply the sandbox disk limit: {why}; pass disk=None to run without one")
    tmp = directory.parent.parent / "tmp"  # Docker's own tmp dir: emptied when dockerd starts
    tmp.mkdir(mode=0o700, exist_ok=True)
    for stale in tmp.glob(f"{IMAGE_PREFIX}*"):  # a creator killed between mkfs and mount left it
        if not owner_alive(stale.name):
            stale.unlink(missing_ok=True)
    image = tmp / f"{IMAGE_PREFIX}{uuid.uuid4().hex[:12]}~{OwnerId.current().to_label()}"
    try:
        with open(image, "wb") as f:
            f.truncate(size_bytes)
        # -d copies Docker's files (empty diff/ and work/, link, lower) into the new file system
        _run(["mkfs.ext4", *MKFS_OPTS, "-d", str(directory), str(image)], "mkfs.ext4")
        _loop_mount(image, directory)
        os.chmod(directory, 0o710)
    finally:
        image.unlink(missing_ok=True)  # mounted: the loop device holds it; else nothing to keep


def prepare_layer_image(root: Path, image: Path, size_bytes: int) -> None:
    """A ``size_bytes`` ext4 file system in sparse file ``image`` holding the tree ``root``
    (``diff/``: a checkpoint's layer, ``work/``): what ``limit_layer`` would make and a
    restore would then fill, made ahead of time (pre-staging) so that a restore only
    mounts it (``mount_layer_image``). ``mkfs.ext4 -d`` keeps owners, modes, xattrs
    (overlay's opaque marks), device files (its whiteouts), hardlinks and holes."""
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    _run(["mkfs.ext4", *MKFS_OPTS, "-d", str(root), str(image)], "mkfs.ext4")
    _copy_times(root, image)


def _copy_times(root: Path, image: Path) -> None:
    """``mkfs.ext4 -d`` keeps whole seconds of each timestamp only: put the nanoseconds back
    (mtime and atime of every entry, from ``root``), so the restored tree is the
    checkpoint's to the nanosecond (build tools compare mtimes). Off the critical path."""
    mnt = image.with_name(image.name + ".times")
    mnt.mkdir(mode=0o700)
    try:
        _loop_mount(image, mnt)
        try:
            for dirpath, dirnames, filenames in os.walk(root):
                rel = Path(dirpath).relative_to(root)
                for name in [*filenames, *dirnames]:
                    st = os.lstat(os.path.join(dirpath, name))
                    os.utime(mnt / rel / name, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
            st = os.lstat(root)
            os.utime(mnt, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            try:
                mounting.umount(mnt)
            except OSError as e:
                raise SandboxLost(f"sandbox disk limit: {e}") from e
    finally:
        mnt.rmdir()


def mount_layer_image(inspect: dict[str, Any], image: Path) -> None:
    """Mount ``image`` (``prepare_layer_image``) as the (created, not started) container's
    writable layer, in place of ``limit_layer``'s empty one; Docker's own ``link`` and
    ``lower`` files are written into it. ``image`` may be unlinked once this returns."""
    directory = layer_dir(inspect)
    if why := unsupported(directory):
        raise ConfigError(f"cannot apply the sandbox disk limit: {why}; pass disk=None to run without one")
    docker_files = {n: (directory / n).read_bytes() for n in ("link", "lower") if (directory / n).is_file()}
    _loop_mount(image, directory)
    for name, data in docker_files.items():
        (directory / name).write_bytes(data)
    os.chmod(directory, 0o710)


def usage(inspect: dict[str, Any]) -> int | None:
    """Bytes in use on the container's capped layer file system; None when it has no cap."""
    try:
        directory = layer_dir(inspect)
    except ConfigError:
        return None
    if not os.path.ismount(directory):
        return None
    st = os.statvfs(directory)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def owner_alive(name: str) -> bool:
    return _label_owner_alive(name.rpartition("~")[2])


def _loop_mount(image: Path, directory: Path) -> None:
    try:
        mounting.loop_mount(image, directory)
    except OSError as e:
        raise SandboxLost(f"sandbox disk limit: {e}") from e


def _run(argv: list[str], what: str) -> None:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise SandboxLost(f"sandbox disk limit: {what} did not finish in {TOOL_TIMEOUT_S:g} s") from e
    if p.returncode != 0:
        raise SandboxLost(f"sandbox disk limit: {what} failed ({p.returncode}): {p.stderr.strip()[-300:]}")
