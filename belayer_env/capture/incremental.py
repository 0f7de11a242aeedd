"""Incremental layer capture: only what changed since the previous capture is copied while
the sandbox is frozen; the full ``layer.tar`` is built after thaw.

Each sandbox has a *mirror* (``<store>/.mirrors/<sandbox>~<owner>/``): a copy of its
upperdir as of its previous capture, plus an index (path -> ``find`` stat line: device,
inode, type, mode, links, owner, size, mtime, ctime). Inside the freeze, ``find`` lists the
upperdir and ``tar --no-recursion`` copies into tmpfs only the entries whose stat line
differs from the index (or whose ctime is too recent to trust: see ``RACY_NS``): that frozen
half is ``delta.py``; this module is the mirror, before the freeze and after it. Any write,
truncate, chmod, chown, xattr change, link or rename of an entry changes its ctime, which
nothing inside the container can set back. After thaw the mirror is brought to the frozen
instant (deleted entries removed, the delta unpacked) and tarred, hashed, into the
checkpoint: every checkpoint holds a complete layer and needs no parent.

Bases, best first: the sandbox's own mirror (its index matches entry by entry); for a
restored sandbox, the mirror when its last tar became the checkpoint restored (entries
older than the restore's ``layer_installed_ns`` are that layer's, checked after thaw
against the mirror's index by type, mode, owner, size and mtime); the checkpoint a
restored sandbox came from (``restored_from``: entries whose ctime is older
than the restore's ``layer_installed_ns`` are still what that checkpoint's layer unpacked
(checked after thaw against the unpacked layer, by path and by type); its ``layer.tar`` is
opened before the freeze, so retention cannot take it away meanwhile); none (everything is
copied, as a full capture). A mirror whose update did not finish has no index and is
rebuilt from scratch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from belayer_env.capture.delta import RACY_NS, Base, Delta, scan, stamp_ns
from belayer_env.store import layer, long_paths
from belayer_env.store.manifest import read_manifest

INDEX = "index.json"
TREE = "tree"



class Mirror:
    """The mirror of one sandbox in one store (used under the store's lock of that sandbox)."""

    def __init__(self, root: Path):
        self.root = root
        self.tree = root / TREE

    def read(self) -> dict[str, Any] | None:
        """The index (``upper``, ``checkpoint``, ``entries``), if the mirror is complete."""
        try:
            data = json.loads((self.root / INDEX).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict) or not self.tree.is_dir():
            return None
        return data

    def load(self, upper: Path) -> dict[str, str] | None:
        """The index's entries, when it describes this very upperdir; else None."""
        data = self.read()
        return data["entries"] if data is not None and data.get("upper") == str(upper) else None

    def drop(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def prepare(mirror: Mirror, upper: Path, restored_from: str | None, store: Any, installed_ns: int | None) -> Base:
    """Pick the base before the freeze (everything slow happens here). ``installed_ns``:
    when a restore had the layer of ``restored_from`` in place, before any process ran."""
    index = mirror.load(upper)
    if index is not None:
        return Base("mirror", index=index)
    data = mirror.read()
    if restored_from and installed_ns and data is not None and data.get("checkpoint") == restored_from:
        # restored from the checkpoint this mirror was last tarred into: the mirror is its layer
        return Base("restored-mirror", index=data["entries"], older_than_ns=installed_ns - RACY_NS,
                    source=restored_from)
    if restored_from and installed_ns:
        with contextlib.suppress(Exception):  # no usable checkpoint: a full capture, not an error
            ck = store.get(restored_from)
            meta = read_manifest(ck.path)["files"]["layer.tar"]
            f = open(Path(ck.path) / "layer.tar", "rb")  # noqa: SIM115 - held open: retention may remove it
            return Base("checkpoint", older_than_ns=installed_ns - RACY_NS, layer_file=f, layer_meta=meta,
                        source=ck.id)
    return Base("none")


def update(mirror: Mirror, upper: Path, delta: Delta, checkpoint_id: str) -> None:
    """After thaw: make the mirror the upperdir of the frozen instant, then record the index
    (and ``checkpoint_id``, the checkpoint its tar goes into)."""
    base = delta.base
    with contextlib.suppress(FileNotFoundError):
        (mirror.root / INDEX).unlink()  # from here until the new index, the mirror is unusable
    mirror.root.parent.mkdir(mode=0o700, exist_ok=True)
    mirror.root.mkdir(mode=0o700, exist_ok=True)
    if base.kind not in ("mirror", "restored-mirror"):
        shutil.rmtree(mirror.tree, ignore_errors=True)
        mirror.tree.mkdir(mode=0o755)
    changed = set(delta.changed)
    if base.kind == "checkpoint":
        layer.install(Path(f"/proc/self/fd/{base.layer_file.fileno()}"), mirror.tree, base.layer_meta)
        unpacked = scan(mirror.tree)
        wrong = [p for p, line in delta.scan.items() if p not in changed and not _same_entry(line, unpacked.get(p))]
        if wrong:
            raise layer.LayerError(f"{len(wrong)} entries unchanged since the restore of {base.source} differ from "
                                   f"its layer (e.g. {wrong[0]!r})")
        present = set(unpacked)
    elif base.kind == "restored-mirror":
        assert base.index is not None
        wrong = [p for p, line in delta.scan.items() if p not in changed and not _same_entry(line, base.index.get(p))]
        if wrong:
            raise layer.LayerError(f"{len(wrong)} entries unchanged since the restore of {base.source} differ from "
                                   f"its layer (e.g. {wrong[0]!r})")
        present = set(base.index)
    elif base.kind == "mirror":
        assert base.index is not None
        present = set(base.index)
    else:
        present = set()
    gone = sorted(present - set(delta.scan), key=lambda x: x.count("/"), reverse=True)
    for p in gone:
        long_paths.remove(mirror.tree, p)
    for p in delta.changed:
        _clear(mirror.tree, p, delta.scan[p].split()[2] == "d")
    if delta.changed:
        layer.extract(delta.tar, mirror.tree, f"unpacking the changed entries into {mirror.tree}")
    # removing or recreating an entry touched its directory's mtime in the mirror: put back
    # the scan's. A changed directory too: tar read its mtime a moment after the scan, and
    # CRIU, dumping meanwhile, makes and removes a temp dir in /tmp (or /), so the copy may
    # carry a later mtime than the index records; a restored layer would then differ from
    # the index its next capture trusts ("entries unchanged since the restore ... differ").
    # The scan's is the frozen instant's, before CRIU touched it.
    changed_dirs = {p for p in changed if delta.scan[p].split()[2] == "d"}
    for d in ({os.path.dirname(p) or "." for p in (*gone, *delta.changed) if p != "."} - changed) | changed_dirs:
        line = delta.scan.get(d)
        if line is not None:
            mtime = stamp_ns(line.split()[8])
            with long_paths.at(mirror.tree, d) as (fd, name):
                os.utime(name, ns=(os.lstat(name, dir_fd=fd).st_atime_ns, mtime), dir_fd=fd, follow_symlinks=False)
    tmp = mirror.root / (INDEX + ".tmp")
    tmp.write_text(json.dumps({"upper": str(upper), "checkpoint": checkpoint_id, "entries": delta.index()}))
    os.replace(tmp, mirror.root / INDEX)


def _clear(root: Path, rel: str, new_is_dir: bool) -> None:
    """Make room for a changed entry: a non-directory goes (tar recreates it); a directory
    that stays one keeps its children but loses its xattrs (tar sets the captured ones)."""
    try:
        with long_paths.at(root, rel) as (fd, name):
            is_dir = stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode)
            if is_dir and new_is_dir:
                where = long_paths.xattr_path(fd, name)
                for key in os.listxattr(where, follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.removexattr(where, key, follow_symlinks=False)
                return
    except OSError:  # not there (nor, for a new deep entry, its parent)
        return
    long_paths.remove(root, rel)


def _same_entry(line: str, other: str | None) -> bool:
    """Same type, mode, owner, mtime (and size, for non-directories) in two stat lines."""
    if other is None:
        return False
    a, b = line.split(), other.split()
    fields = (2, 3, 5, 6, 8) if a[2] == "d" else (2, 3, 5, 6, 7, 8)
    return all(a[i] == b[i] for i in fields)


def tar_tree(tree: Path, fo: Any, max_bytes: int | None) -> tuple[int, str]:
    """``tar`` of the mirror into ``fo`` (hashing on the way): the checkpoint's layer.tar."""
    argv = ["tar", "--create", "--sparse", "--file=-", f"--directory={tree}", *layer.TAR_OPTS, "."]
    return layer.stream_tar(argv, fo, max_bytes, f"the mirror {tree}")
