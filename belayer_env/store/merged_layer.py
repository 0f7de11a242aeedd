"""A fork's whole layer for its next capture: the shared lower layer's entries still visible
under the fork's own upperdir, merged with that upperdir (overlay whiteouts and opaque
directories honoured), as lists or as one tar."""

from __future__ import annotations

import os
import shutil
import stat as stat_mod
import subprocess
import uuid
from pathlib import Path
from typing import IO

from belayer_env.store import layer
from belayer_env.store.shared_layer import SharedLower


def _kind(path: Path) -> str:
    """``wh`` (overlay whiteout), ``opq`` (opaque directory), ``dir``, or ``other``."""
    st = os.lstat(path)
    if stat_mod.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return "wh"
    if stat_mod.S_ISDIR(st.st_mode):
        try:
            return "opq" if os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y" else "dir"
        except OSError:
            return "dir"
    return "other"


def merged_lists(shared: SharedLower, upper: Path) -> tuple[list[str], list[str]]:
    """The entries of the shared layer still visible under ``upper`` (a fork's upperdir,
    or a copy of it), and every entry of ``upper``: together, the fork's whole layer."""
    up: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(upper):
        rel = os.path.relpath(dirpath, upper)
        up[rel] = _kind(Path(dirpath)) if rel != "." else "dir"
        for n in filenames:
            p = n if rel == "." else f"{rel}/{n}"
            up[p] = _kind(upper / p)
        for n in list(dirnames):
            p = n if rel == "." else f"{rel}/{n}"
            if os.path.islink(upper / p):
                up[p] = "other"
    hides = {p for p, k in up.items() if k in ("wh", "other", "opq")}
    lower: list[str] = []
    for _, p in shared.entries():
        if p in up:
            continue  # replaced by the upper entry (a directory: its metadata wins, children merge)
        parts = p.split("/")
        if any("/".join(parts[:i]) in hides for i in range(1, len(parts))):
            continue
        lower.append(p)
    return lower, sorted(up)


def tar_merged(shared: SharedLower, upper: Path, fo: IO[bytes], scratch: Path,
               max_bytes: int | None) -> tuple[int, str]:
    """tar of the fork's whole layer (``merged_lists``) into ``fo``, hashing on the way:
    what a checkpoint of a fork records."""
    lower, up = merged_lists(shared, upper)
    lists = []
    for n, paths in (("lower", lower), ("upper", up)):
        f = scratch / f"merged-{n}-{uuid.uuid4().hex[:8]}.list"
        f.write_bytes(b"".join(os.fsencode("./" + p if p != "." else ".") + b"\0" for p in paths))
        lists.append(f)
    argv = ["tar", "--create", "--sparse", "--no-recursion", "--null", "--file=-", *layer.TAR_OPTS,
            f"--directory={shared.diff.resolve()}", f"--files-from={lists[0]}",
            f"--directory={upper.resolve()}", f"--files-from={lists[1]}"]  # -C before -T: positional
    try:
        return layer.stream_tar(argv, fo, max_bytes, f"the fork's layer (shared {shared.name} + {upper})")
    finally:
        for f in lists:
            f.unlink(missing_ok=True)


def tar_merged_from_tar(shared: SharedLower, upper_tar: Path, fo: IO[bytes], scratch: Path,
                        max_bytes: int | None) -> tuple[int, str]:
    """``tar_merged`` from a tar of the fork's upperdir (the ``paused`` capture's)."""
    tree = scratch / f"upper-{uuid.uuid4().hex[:8]}"
    tree.mkdir(mode=0o700)
    try:
        proc = subprocess.run(["tar", "--extract", f"--file={upper_tar}", f"--directory={tree}", *layer.TAR_OPTS,
                               "--same-permissions", "--same-owner"], capture_output=True)
        if proc.returncode != 0:
            raise layer.LayerError(f"unpacking the fork's upperdir failed: {proc.stderr.decode(errors='replace')[-500:]}")
        return tar_merged(shared, tree, fo, scratch, max_bytes)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
