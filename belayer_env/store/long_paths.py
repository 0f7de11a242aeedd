"""Layer entries whose path is past what the kernel takes in one call (PATH_MAX, 4096 bytes).

An agent can make them (``for i in $(seq 50); do mkdir d$(printf '%0100d' 0) && cd d*;
done``). GNU tar archives such a tree when it walks it itself (directory fds), but stats a
listed name, and extracts every member, by its whole path: ``File name too long``. So:

- a capture lists, instead of each long entry, its deepest ancestor with a short path, with
  recursion (``anchors``): tar reaches what is below by fds;
- an extraction that GNU tar failed only because of long names (``only_too_long``) is
  finished here (``extract_long``): the members whose name (or hard-link target) is long are
  made through directory fds opened one component at a time (never through a symlink), as
  tar makes them (type, mode, numeric owner, xattrs, mtime, contents with holes, hard
  links), then the directories they went into get back their archived mtime;
- ``at`` / ``remove`` do single operations on such a path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

LONG = 4000
"""A path this long (bytes) or longer is handled through directory fds (PATH_MAX is 4096)."""
TOO_LONG = "File name too long"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


def is_long(path: str | Path) -> bool:
    return len(os.fsencode(str(path))) >= LONG


def _parts(rel: str) -> list[str]:
    return [c for c in rel.split("/") if c not in ("", ".")]


def anchors(paths: Iterable[str]) -> list[str]:
    """For each long path of ``paths`` (relative, as tar lists them with ``./``), its deepest
    ancestor whose own path is short; only the outermost of these."""
    found = set()
    for p in paths:
        if not is_long("./" + p):
            continue
        acc = ""
        for comp in _parts(p)[:-1]:
            nxt = f"{acc}/{comp}" if acc else comp
            if is_long("./" + nxt):
                break
            acc = nxt
        found.add(acc or ".")
    out: list[str] = []
    for a in sorted(found, key=len):
        if not any(under(a, [o]) for o in out):
            out.append(a)
    return out


def under(path: str, roots: Iterable[str]) -> bool:
    """``path`` is one of ``roots`` or below one."""
    return any(r == "." or path == r or path.startswith(r + "/") for r in roots)


def only_too_long(stderr: str) -> bool:
    """GNU tar's errors (``--quoting-style=escape``: one per line) are all about long names:
    ENAMETOOLONG, or a line that names a long path (a sparse member's failed open says no more)."""
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.endswith("due to previous errors")]
    return bool(lines) and all(ln.endswith(TOO_LONG) or is_long(ln) for ln in lines)


class Tree:
    """Directories under ``root`` opened one component at a time with ``O_NOFOLLOW``; the
    chain of the last one is kept open (members come in tree order)."""

    def __init__(self, root: Path):
        self.root = os.open(root, _DIR)
        self._chain: list[tuple[str, int]] = []

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reset()
        os.close(self.root)

    def reset(self) -> None:
        for _, fd in self._chain:
            os.close(fd)
        self._chain = []

    def dir(self, comps: list[str], create: bool = False) -> int:
        keep = 0
        while keep < min(len(comps), len(self._chain)) and self._chain[keep][0] == comps[keep]:
            keep += 1
        for _, fd in self._chain[keep:]:
            os.close(fd)
        del self._chain[keep:]
        fd = self._chain[-1][1] if self._chain else self.root
        for comp in comps[keep:]:
            try:
                new = os.open(comp, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(comp, 0o755, dir_fd=fd)
                new = os.open(comp, _DIR, dir_fd=fd)
            self._chain.append((comp, new))
            fd = new
        return fd

    def parent(self, rel: str, create: bool = False) -> tuple[int, str]:
        comps = _parts(rel)
        return self.dir(comps[:-1], create), comps[-1]


@contextlib.contextmanager
def at(root: Path, rel: str) -> Iterator[tuple[int | None, str]]:
    """``(dir_fd, name)`` for an ``os`` call on ``root/rel``: its full path when short enough,
    else its parent opened through fds and its last component."""
    full = os.path.join(root, rel)
    if not is_long(full):
        yield None, full
        return
    with Tree(root) as tree:
        yield tree.parent(rel)


def xattr_path(fd: int | None, name: str) -> str:
    """A path the ``*xattr`` calls (which take no dir fd) can use for ``(fd, name)``."""
    return name if fd is None else f"/proc/self/fd/{fd}/{name}"


def remove(root: Path, rel: str) -> None:
    """Remove ``root/rel`` (a whole tree if a directory); nothing if it is not there."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), at(root, rel) as (fd, name):
        st = os.lstat(name, dir_fd=fd)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, ignore_errors=True, dir_fd=fd)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)


def _ns(stamp: str) -> int:
    sec, _, frac = stamp.partition(".")
    return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])


def _times(m: tarfile.TarInfo) -> tuple[int, int]:
    """(atime, mtime) in ns, exact from the pax header when there (tarfile's floats are not)."""
    mtime = _ns(m.pax_headers["mtime"]) if "mtime" in m.pax_headers else int(m.mtime) * 1_000_000_000
    atime = _ns(m.pax_headers["atime"]) if "atime" in m.pax_headers else mtime
    return atime, mtime


def _set_meta(fd: int, name: str, m: tarfile.TarInfo) -> None:
    os.chown(name, m.uid, m.gid, dir_fd=fd, follow_symlinks=False)
    if not m.issym():
        os.chmod(name, stat.S_IMODE(m.mode), dir_fd=fd)  # after chown, which clears setuid bits
    for key, value in m.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            os.setxattr(xattr_path(fd, name), key[len("SCHILY.xattr."):], value.encode("utf-8", "surrogateescape"),
                        follow_symlinks=False)
    os.utime(name, ns=_times(m), dir_fd=fd, follow_symlinks=False)


def _same(st: os.stat_result, m: tarfile.TarInfo, target: os.stat_result | None) -> bool:
    """What is there is what ``m`` describes (GNU tar made it: a name just under the limit)."""
    if m.islnk():
        return target is not None and (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino)
    kinds = {tarfile.REGTYPE: stat.S_ISREG, tarfile.AREGTYPE: stat.S_ISREG, tarfile.SYMTYPE: stat.S_ISLNK,
             tarfile.CHRTYPE: stat.S_ISCHR, tarfile.BLKTYPE: stat.S_ISBLK, tarfile.FIFOTYPE: stat.S_ISFIFO}
    check = kinds.get(m.type, stat.S_ISREG)
    return check(st.st_mode) and st.st_mtime_ns == _times(m)[1] and (not m.isreg() or st.st_size == m.size)


def _write(fd: int, data: IO[bytes] | None, size: int) -> None:
    with open(fd, "wb", closefd=False) as out:
        while data is not None and (chunk := data.read(_CHUNK)):
            if chunk.strip(b"\0"):
                out.write(chunk)
            else:
                out.seek(len(chunk), os.SEEK_CUR)  # a hole stays a hole
        out.truncate(size)


def _make(tf: tarfile.TarFile, m: tarfile.TarInfo, fd: int, name: str, links: Tree, target: str) -> bool:
    """Make member ``m`` as ``name`` in directory ``fd``; False when it was there already."""
    try:
        st = os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        st = None
    if st is not None:
        if m.isdir() and stat.S_ISDIR(st.st_mode):
            return True
        tst = None
        if m.islnk():
            with contextlib.suppress(OSError):
                tfd, tname = links.parent(target)
                tst = os.lstat(tname, dir_fd=tfd)
        if _same(st, m, tst):
            return False
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=fd)
            links.reset()
        else:
            os.unlink(name, dir_fd=fd)
    if m.isdir():
        os.mkdir(name, 0o700, dir_fd=fd)
        return True  # its metadata once its children are in (``extract_long``)
    if m.islnk():
        tfd, tname = links.parent(target)
        os.link(tname, name, src_dir_fd=tfd, dst_dir_fd=fd, follow_symlinks=False)
        return True
    if m.issym():
        os.symlink(m.linkname, name, dir_fd=fd)
    elif m.ischr() or m.isblk():
        kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
        os.mknod(name, 0o600 | kind, os.makedev(m.devmajor, m.devminor), dir_fd=fd)
    elif m.isfifo():
        os.mkfifo(name, 0o600, dir_fd=fd)
    else:
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            _write(out, tf.extractfile(m), m.size)
        finally:
            os.close(out)
    _set_meta(fd, name, m)
    return True


def extract_long(archive: IO[bytes], dest: Path) -> int:
    """Make in ``dest`` the members of ``archive`` (a file or a stream, read once) whose name
    or hard-link target is long; the number made."""
    times: dict[str, tuple[int, int]] = {}  # every directory's (atime, mtime)
    made_dirs: dict[str, tarfile.TarInfo] = {}
    parents: set[str] = set()
    made = 0
    with tarfile.open(fileobj=archive, mode="r|") as tf, Tree(dest) as tree, Tree(dest) as links:
        for m in tf:
            tf.members = []  # read once, in order: keep no index of a layer's every member
            name = "/".join(_parts(m.name))
            target = "/".join(_parts(m.linkname)) if m.islnk() else ""
            if m.isdir():
                times[name] = _times(m)
            if not name or not (is_long("./" + name) or (target and is_long("./" + target))):
                continue
            fd, base = tree.parent(name, create=True)
            if _make(tf, m, fd, base, links, target):
                made += 1
                parents.add(name.rpartition("/")[0])
                if m.isdir():
                    made_dirs[name] = m
        for name in sorted(set(made_dirs) | (parents & set(times)), key=len, reverse=True):
            if not name:
                os.utime(dest, ns=times[name], follow_symlinks=False)
                continue
            fd, base = tree.parent(name)
            if name in made_dirs:
                _set_meta(fd, base, made_dirs[name])
            else:  # a short directory GNU tar made: its mtime, which our entries changed
                os.utime(base, ns=times[name], dir_fd=fd, follow_symlinks=False)
    return made
