"""Directories only this user may change: a checkpoint store and its scratch space.

Whoever can write a store decides what a restore starts (its layer, its processes), so a
store is refused with a ``ConfigError`` when anyone but this user (and root) could change
it *or any directory above it*: the owner of ``/tmp/p`` can rename ``/tmp/p/store`` away and
put their own in its place, whatever the store's own mode. As ssh's StrictModes does for its
keys, the path is walked from ``/`` one component at a time, by directory fds (``O_PATH |
O_NOFOLLOW``, so what is checked is what is walked into, and a component swapped meanwhile
is seen, never followed):

- every directory on the way is owned by root or this user;
- one that others may write is passed only when it is sticky (``/tmp``, ``/dev/shm``) and
  the entry taken from it is root's or ours (the sticky bit keeps others from renaming it);
- a symlink is followed (resolved here, by the same rules) only from a directory others
  cannot write, or when root or this user owns it and it has one name (a hard link of
  someone's link, where ``fs.protected_hardlinks=0`` allows one, is not ours to follow);
- the store itself is this user's and writable by no one else (narrowed to 0700 when ours).

Missing directories are created on the way (0755 above, 0700 the last), then checked like
the rest: a name another user took first is refused, not used.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

from belayer_core.errors import ConfigError

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_MAX_LINKS = 40
_HINT = "use a private directory, e.g. under ~/.belayer"


def ensure_private_dir(path: Path, what: str, *, create: bool = True) -> Path:
    """``path`` as a directory owned by the effective user and writable by no one else, below
    directories only root or this user can change (created 0700 with its missing parents when
    ``create``; an existing one readable by others is narrowed to 0700)."""
    fd, st = _walk(path, what, create=create)
    try:
        euid = os.geteuid()
        if st.st_uid != euid:
            raise ConfigError(f"{what} {path} is owned by {_owner(st.st_uid)}, not by this user (uid {euid}): "
                              f"another user could change what is restored from it; refused ({_HINT})")
        if st.st_mode & _OTHERS_WRITE:
            raise ConfigError(f"{what} {path} is writable by others (mode {_mode(st)}): refused "
                              f"(chmod 700 {path} if its content is yours)")
        if stat.S_IMODE(st.st_mode) != 0o700:
            _chmod_private(fd)
    finally:
        os.close(fd)
    return path


def ensure_shared_base(path: Path, what: str) -> Path:
    """A directory under which a private one is made (``scratch=``): root's or this user's,
    below directories only they can change, and where others may write, sticky (``/dev/shm``,
    ``/tmp``), so nobody else can replace what this user makes in it. Created private when
    missing."""
    os.close(_walk(path, what, create=True)[0])
    return path


def _walk(path: Path, what: str, *, create: bool) -> tuple[int, os.stat_result]:
    """An ``O_PATH`` fd of the directory ``path`` names and its stat, reached from ``/`` by
    the rules of the module's docstring (``ConfigError`` naming the first that breaks one)."""
    pending = _parts(os.path.join(os.getcwd(), path))
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    stack = [(root, "/", os.fstat(root))]  # the directories walked into, for ".."
    links = 0
    try:
        _check_dir(stack[0][2], _Where(what, path, "/"))
        while pending:
            name = pending.pop(0)
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            parent_fd, parent, parent_st = stack[-1]
            where = _Where(what, path, os.path.join(parent, name))
            mode = (0o755 if pending else 0o700) if create else None
            fd = _open_entry(parent_fd, name, where, mode)
            st = os.fstat(fd)
            stack.append((fd, where.shown, st))  # closed with the rest when refused
            if parent_st.st_mode & _OTHERS_WRITE and st.st_uid not in (0, os.geteuid()):
                kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "an entry"
                raise ConfigError(f"{where} is {kind} owned by {_owner(st.st_uid)} in {parent}, a directory others may "
                                  f"write (mode {_mode(parent_st)}): its owner can replace it; refused ({_HINT})")
            if stat.S_ISLNK(st.st_mode):
                if parent_st.st_mode & _OTHERS_WRITE and st.st_nlink > 1:
                    raise ConfigError(f"{where} is a symlink with {st.st_nlink} names in {parent}, a directory "
                                      f"others may write: a hard link of a link made elsewhere; refused ({_HINT})")
                stack.pop()
                target = os.readlink("", dir_fd=fd)
                os.close(fd)
                links += 1
                if links > _MAX_LINKS:
                    raise ConfigError(f"{where}: more than {_MAX_LINKS} symlinks on the way; refused")
                while target.startswith("/") and len(stack) > 1:
                    os.close(stack.pop()[0])
                pending[:0] = _parts(target)
                continue
            _check_dir(st, where)
        fd, _, st = stack.pop()
        return fd, st
    finally:
        for fd, _, _ in stack:
            os.close(fd)


class _Where:
    """How an error names the place: the store asked for, and the component at fault."""

    def __init__(self, what: str, path: Path, shown: str):
        self.what, self.path, self.shown = what, path, shown

    def __str__(self) -> str:
        same = os.path.abspath(self.path) == self.shown
        return f"{self.what} {self.path}" if same else f"{self.what} {self.path}: {self.shown}"


def _open_entry(parent_fd: int, name: str, where: _Where, mkdir_mode: int | None) -> int:
    """``O_PATH | O_NOFOLLOW`` fd of ``name`` in ``parent_fd``; a missing one is made a
    directory of ``mkdir_mode`` first (None: refused)."""
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(name, flags, dir_fd=parent_fd)
        except FileNotFoundError:
            if mkdir_mode is None:
                raise
        try:
            os.mkdir(name, mkdir_mode, dir_fd=parent_fd)
        except FileExistsError:
            pass  # made meanwhile, by whoever: checked like anything else
        return os.open(name, flags, dir_fd=parent_fd)
    except OSError as e:
        raise ConfigError(f"{where}: {e.strerror}") from e


def _check_dir(st: os.stat_result, where: _Where) -> None:
    """A directory root or this user owns, sticky where others may write; else ``ConfigError``."""
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{where} is not a directory")
    if st.st_uid not in (0, os.geteuid()):
        raise ConfigError(f"{where} is owned by {_owner(st.st_uid)}, mode {_mode(st)}, neither this user "
                          f"(uid {os.geteuid()}) nor root: its owner can replace what is in it; refused ({_HINT})")
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"{where} is writable by others and not sticky (mode {_mode(st)}, owner "
                          f"{_owner(st.st_uid)}): anyone can replace what is in it; refused ({_HINT})")


def _chmod_private(path_fd: int) -> None:
    """chmod 700 the directory an ``O_PATH`` fd holds (through a real fd of that very inode)."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=path_fd)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"
