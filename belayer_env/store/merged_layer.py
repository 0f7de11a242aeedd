"""A fork's whole layer for its next capture: the shared lower layer's entries still visible
under the fork's own upperdir, merged with that upperdir (overlay whiteouts and opaque
directories honoured), as lists or as one tar."""

from __future__ import annotations

import os
import shutil
import stat as stat_mod
import uuid
from pathlib import Path
from typing import IO

from belayer_env.store import layer, long_paths
from belayer_env.store.shared_layer import SharedLower


def _kind(fd: int, name: str) -> str:
    """``wh`` (overlay whiteout), ``opq`` (opaque directory), ``dir``, ``link`` or ``other``
    of ``name`` in directory ``fd`` (by fds: a path past PATH_MAX is fine)."""
    st = os.lstat(name, dir_fd=fd)
    if stat_mod.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return "wh"
    if stat_mod.S_ISLNK(st.st_mode):
        return "link"
    if stat_mod.S_ISDIR(st.st_mode):
        try:
            opaque = os.getxattr(long_paths.xattr_path(fd, name), "trusted.overlay.opaque", follow_symlinks=False)
        except OSError:
            return "dir"
        return "opq" if opaque == b"y" else "dir"
    return "other"


def upper_kinds(upper: Path) -> dict[str, str]:
    """Every entry of ``upper`` -> its kind (``_kind``), walked by directory fds."""
    up: dict[str, str] = {".": "dir"}
    for dirpath, dirnames, filenames, fd in os.fwalk(upper):
        rel = os.path.relpath(dirpath, upper)
        for n in (*dirnames, *filenames):
            up[n if rel == "." else f"{rel}/{n}"] = _kind(fd, n)
    return {p: ("other" if k == "link" else k) for p, k in up.items()}


def merged_lists(shared: SharedLower, upper: Path) -> tuple[list[str], list[str]]:
    """The entries of the shared layer still visible under ``upper`` (a fork's upperdir,
    or a copy of it), and every entry of ``upper``: together, the fork's whole layer."""
    return _merged(shared, upper_kinds(upper))


def _merged(shared: SharedLower, up: dict[str, str]) -> tuple[list[str], list[str]]:
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
    kinds = upper_kinds(upper)
    lower, up = _merged(shared, kinds)
    if any(long_paths.is_long("./" + p) for p in (*lower, *up)):  # tar cannot list those: merge a copy
        return _tar_rebuilt(shared, upper, kinds, fo, scratch, max_bytes)
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


def _children(root: Path, rel: str) -> list[str]:
    try:
        with long_paths.at(root, rel) as (fd, name):
            dfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    except OSError:
        return []
    try:
        return os.listdir(dfd)
    finally:
        os.close(dfd)


def _tar_rebuilt(shared: SharedLower, upper: Path, kinds: dict[str, str], fo: IO[bytes], scratch: Path,
                 max_bytes: int | None) -> tuple[int, str]:
    """The same layer with paths past PATH_MAX: the shared layer copied, what the upperdir
    hides removed from the copy, the upperdir copied over it, the whole tarred (tar walks a
    tree by fds)."""
    tree = scratch / f"merged-{uuid.uuid4().hex[:8]}"
    tree.mkdir(mode=0o700)
    try:
        layer.copy_tree(shared.diff.resolve(), tree)
        for p, k in sorted(kinds.items(), key=lambda x: x[0].count("/")):
            if p != "." and k in ("wh", "other"):
                long_paths.remove(tree, p)
            elif k == "opq":  # an opaque directory: nothing of the shared one's shows through
                for child in _children(tree, p):
                    long_paths.remove(tree, child if p == "." else f"{p}/{child}")
        layer.copy_tree(upper, tree)
        argv = ["tar", "--create", "--sparse", "--file=-", f"--directory={tree}", *layer.TAR_OPTS, "."]
        return layer.stream_tar(argv, fo, max_bytes, f"the fork's layer (shared {shared.name} + {upper})")
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def tar_merged_from_tar(shared: SharedLower, upper_tar: Path, fo: IO[bytes], scratch: Path,
                        max_bytes: int | None) -> tuple[int, str]:
    """``tar_merged`` from a tar of the fork's upperdir (the ``paused`` capture's)."""
    tree = scratch / f"upper-{uuid.uuid4().hex[:8]}"
    tree.mkdir(mode=0o700)
    try:
        layer.extract(upper_tar, tree, "unpacking the fork's upperdir")  # paths past PATH_MAX included
        return tar_merged(shared, tree, fo, scratch, max_bytes)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
