"""Incremental layer capture: only what changed since the previous capture is copied while
the sandbox is frozen; the full ``layer.tar`` is built after thaw.

Each sandbox has a *mirror* (``<store>/.mirrors/<sandbox>~<owner>/``): a copy of its
upperdir as of its previous capture, plus an index (path -> ``find`` stat line: device,
inode, type, mode, links, owner, size, mtime, ctime). Inside the freeze, ``find`` lists the
upperdir and ``tar --no-recursion`` copies into tmpfs only the entries whose stat line
differs from the index (or whose ctime is too recent to trust: see ``RACY_NS``). Any write,
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
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from belayer_env.criu import runtime
from belayer_env.store import layer, long_paths
from belayer_env.store.manifest import read_manifest

INDEX = "index.json"
TREE = "tree"
RACY_NS = 20_000_000
"""Entries whose ctime is this close to a reference instant (the scan; a restore's layer
install) are never trusted as unchanged: a coarse file-system clock (one tick, <= 10 ms)
could give a later write the same or an older ctime (5 ticks at HZ=250)."""
_FIND_FMT = r"%P\0%D %i %y %m %n %U %G %s %T@ %C@\0"


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


class Base:
    """What the frozen scan compares against (prepared before the freeze)."""

    def __init__(self, kind: str, index: dict[str, str] | None = None, older_than_ns: int = 0,
                 layer_file: Any = None, layer_meta: dict[str, Any] | None = None, source: str | None = None):
        self.kind, self.index, self.older_than_ns = kind, index, older_than_ns
        self.layer_file, self.layer_meta, self.source = layer_file, layer_meta, source

    def unchanged(self, path: str, line: str) -> bool:
        if self.kind == "mirror":
            assert self.index is not None
            return self.index.get(path) == line
        if self.kind in ("checkpoint", "restored-mirror"):
            return ctime_ns(line) < self.older_than_ns
        return False

    def close(self) -> None:
        if self.layer_file is not None:
            self.layer_file.close()
            self.layer_file = None


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


class Delta:
    """Scan + copy of the changed entries, started once frozen (``start``), awaited before
    the sandbox resumes (``wait``)."""

    def __init__(self, upper: Path, scratch: Path, base: Base, max_bytes: int | None, procs: Path | None = None):
        self.upper, self.scratch, self.base, self.max_bytes = upper, scratch, base, max_bytes
        self.procs = procs
        self.tar = scratch / "delta.tar"
        self.scan: dict[str, str] = {}
        self.changed: list[str] = []
        self.mapped: set[str] = set()
        self.retried = False
        self.scan_ns = 0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="belayer-layer-delta")
        self._thread.start()

    def _run(self) -> None:
        try:
            self.scan_ns = time.time_ns()
            self.scan = scan(self.upper)
            inodes, paths = shared_writable(self.procs) if self.procs is not None else (set(), set())
            self.mapped = {p for p, line in self.scan.items() if p in paths or int(line.split()[1]) in inodes}
            self.changed = [p for p, line in self.scan.items()
                            if p in self.mapped or not self.base.unchanged(p, line)]
            if self.changed:
                copy_entries(self.upper, self.changed, self.tar, self.scratch / "delta.list", self.max_bytes)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait
            self.error = e

    def wait(self) -> None:
        """Wait for the copy (still frozen). CRIU briefly makes a directory in the
        container's /tmp (or /) to read an over-mounted tmpfs (``cr-tmpfs.XXXXXX``,
        ``.criu.mntns.XXXXXX``): a scan that saw one, or a copy that lost an entry
        meanwhile, is done again now, CRIU's dump being over."""
        if self._thread is None:
            self.start()
        assert self._thread is not None
        self._thread.join()
        if isinstance(self.error, layer.LayerTooLarge):
            raise self.error
        if self.error is not None or any(_criu_temp(p) for p in self.changed):
            self.error = None
            self.retried = True
            self._run()
        if self.error is not None:
            raise self.error

    def index(self) -> dict[str, str]:
        """The new index: racy entries get a line that never matches."""
        limit = self.scan_ns - RACY_NS
        return {p: (line if ctime_ns(line) < limit and p not in self.mapped else line + " racy")
                for p, line in self.scan.items()}


def shared_writable(procs: Path) -> tuple[set[int], set[str]]:
    """Inode numbers and paths (relative to the container's root) of every file of the
    container's root file system mapped shared and writable by a process listed in
    ``procs`` (a cgroup's ``cgroup.procs``). Writes through such a mapping change the file
    without changing its ctime (only a write fault does, and a writable page faults once),
    so these files are copied now and at the next capture. /proc/PID/maps names the
    overlay's device, the inode (the upper one here, overlay without xino) and the path as
    the process sees it; an entry of the upperdir matching either is taken."""
    inodes: set[int] = set()
    paths: set[str] = set()
    try:
        pids = procs.read_text().split()
    except OSError:
        return inodes, paths
    for pid in pids:
        try:
            root = os.stat(f"/proc/{pid}/root").st_dev
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.rstrip("\n").split(maxsplit=5)
                    if len(fields) >= 5 and fields[1][1] == "w" and fields[1][3] == "s" and fields[4] != "0":
                        major, minor = fields[3].split(":")
                        if os.makedev(int(major, 16), int(minor, 16)) == root:
                            inodes.add(int(fields[4]))
                            if len(fields) == 6 and fields[5].startswith("/"):
                                paths.add(fields[5].removesuffix(" (deleted)").lstrip("/"))
        except (OSError, ValueError, IndexError):
            continue
    return inodes, paths


def _criu_temp(path: str) -> bool:
    name = path.rpartition("/")[2]
    return path.count("/") <= 1 and (name.startswith("cr-tmpfs.") or name.startswith(".criu.mntns."))


def scan(upper: Path) -> dict[str, str]:
    """Every entry of ``upper`` (``.`` for itself) -> its stat line, in one ``find``."""
    proc = _run_boosted(["find", str(upper), "-printf", _FIND_FMT])
    if proc.returncode != 0:
        raise layer.LayerChanged(f"find {upper} failed: {proc.stderr.decode(errors='replace').strip()[-300:]}")
    parts = proc.stdout.split(b"\0")
    out = {}
    for i in range(0, len(parts) - 1, 2):
        out[os.fsdecode(parts[i]) or "."] = parts[i + 1].decode()
    return out


def copy_entries(upper: Path, paths: list[str], dest: Path, listing: Path, max_bytes: int | None) -> None:
    """tar exactly ``paths`` (no recursion) of ``upper`` into ``dest``. A path past PATH_MAX
    (tar would stat it by its whole name) goes in with its deepest short ancestor's whole
    tree, which tar walks by directory fds (``long_paths.anchors``)."""
    deep = long_paths.anchors(paths)
    listing.write_bytes(b"".join(os.fsencode("./" + p if p != "." else ".") + b"\0" for p in paths
                                 if not long_paths.under(p, deep)))
    argv = ["tar", "--create", "--sparse", "--no-recursion", "--null", f"--file={dest}", *layer.TAR_OPTS,
            f"--directory={upper}", f"--files-from={listing}"]  # -C before -T: positional
    if deep:
        anchored = listing.with_name(listing.name + ".deep")
        anchored.write_bytes(b"".join(os.fsencode("./" + a if a != "." else ".") + b"\0" for a in deep))
        argv += ["--recursion", f"--files-from={anchored}"]
    if max_bytes is not None and shutil.which("prlimit"):
        argv = ["prlimit", f"--fsize={max_bytes}:{max_bytes}", "--", *argv]
    proc = _run_boosted(argv)
    if proc.returncode != 0:
        if max_bytes is not None and dest.exists() and dest.stat().st_size >= max_bytes:
            raise layer.LayerTooLarge(f"the writable layer's changes are larger than the checkpoint limit of "
                                      f"{max_bytes} bytes (CheckpointStore.max_layer_bytes, $BELAYER_MAX_LAYER_BYTES)")
        raise layer.LayerError(f"tar of the changed entries of {upper} failed ({proc.returncode}): "
                               f"{proc.stderr.decode(errors='replace').strip()[-500:]}")


def _run_boosted(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    """``subprocess.run`` in a session of its own at ``runtime.CRIU_NICE`` (it runs frozen)."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True) as proc:
        runtime.boost(proc.pid)
        out, err = proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


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
            mtime = _ns(line.split()[8])
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


def ctime_ns(line: str) -> int:
    return _ns(line.split()[9])


def _ns(stamp: str) -> int:
    sec, _, frac = stamp.partition(".")
    return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])


def tar_tree(tree: Path, fo: Any, max_bytes: int | None) -> tuple[int, str]:
    """``tar`` of the mirror into ``fo`` (hashing on the way): the checkpoint's layer.tar."""
    argv = ["tar", "--create", "--sparse", "--file=-", f"--directory={tree}", *layer.TAR_OPTS, "."]
    return layer.stream_tar(argv, fo, max_bytes, f"the mirror {tree}")
