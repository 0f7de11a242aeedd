"""Directories only this user may change: a checkpoint store and its scratch space.

Whoever can write a store decides what a restore starts (its layer, its processes), so a
store that another local user created first (``/tmp/belayer-checkpoints`` made by
``nobody``), or that anyone else may write, is refused with a ``ConfigError`` rather than
used: chmod does not take a directory back from its owner, who can rename what is in it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from belayer_core.errors import ConfigError

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def ensure_private_dir(path: Path, what: str, *, create: bool = True) -> Path:
    """``path`` as a directory owned by the effective user and writable by no one else
    (created 0700 with its missing parents when ``create``; an existing one readable by
    others is narrowed to 0700). A symlink is followed only when this user owns it."""
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError as e:  # a file, or a dangling symlink, holds the name
            raise ConfigError(f"{what} {path} exists and is not a directory") from e
    euid = os.geteuid()
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != euid:
        raise ConfigError(f"{what} {path} is a symlink owned by uid {link.st_uid}, not by this user "
                          f"(uid {euid}): refused (use a private directory, e.g. under ~/.belayer)")
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory")
    if st.st_uid != euid:
        raise ConfigError(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {euid}): "
                          "another user could change what is restored from it; refused (use a private "
                          "directory, e.g. under ~/.belayer)")
    if st.st_mode & _OTHERS_WRITE:
        raise ConfigError(f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): refused "
                          f"(chmod 700 {path} if its content is yours)")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def ensure_shared_base(path: Path, what: str) -> Path:
    """A directory under which a private one is made (``scratch=``): this user's or root's,
    and where others may write, sticky (``/dev/shm``, ``/tmp``), so nobody else can replace
    what this user makes in it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ensure_private_dir(path, what)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"{what} {path} is owned by uid {st.st_uid}, neither this user nor root: refused")
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"{what} {path} is writable by others and not sticky: refused")
    return path
