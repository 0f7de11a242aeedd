"""The frozen half of an incremental capture: ``find`` lists the sandbox's upperdir and
``tar --no-recursion`` copies into the capture's scratch (tmpfs) only the entries whose stat
line differs from the base's (``Base``: the mirror's index, or what a restore installed), or
whose ctime is too recent to trust (``RACY_NS``), or that a process maps shared and writable.
It runs inside the freeze, beside CRIU's memory dump (``Delta.start`` once frozen,
``Delta.wait`` before the sandbox resumes). The mirror it is compared with and brought up to
date after thaw is ``incremental.py``'s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from belayer_env.criu import runtime
from belayer_env.store import layer, long_paths

RACY_NS = 20_000_000
"""Entries whose ctime is this close to a reference instant (the scan; a restore's layer
install) are never trusted as unchanged: a coarse file-system clock (one tick, <= 10 ms)
could give a later write the same or an older ctime (5 ticks at HZ=250)."""
_FIND_FMT = r"%P\0%D %i %y %m %n %U %G %s %T@ %C@\0"


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


def ctime_ns(line: str) -> int:
    return stamp_ns(line.split()[9])


def stamp_ns(stamp: str) -> int:
    sec, _, frac = stamp.partition(".")
    return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])
