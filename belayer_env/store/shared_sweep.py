"""Removing forks' shared layer copies once no container uses them and no fork is being made
from them (``belayer gc`` and every fork's clean-up call ``sweep``)."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import docker

from belayer_env.sandbox.docker_api import translate_errors
from belayer_env.store.shared_layer import (
    ALIAS_PREFIX,
    LABEL,
    LINK_FILE,
    LINK_PREFIX,
    READY,
    aliases_of,
    lowers_root,
    open_dir,
    remove_copy,
)
from belayer_env.store.store import owner_alive, owner_tag


def sweep(client: docker.DockerClient, docker_root: str | Path, *, dry_run: bool = False) -> list[str]:
    """Remove every shared copy that no container uses and no fork is being made from,
    with its link; and what a killed maker left. Returns the names removed (``dry_run``:
    the names it would remove, removing nothing)."""
    base = lowers_root(docker_root)
    removed: list[str] = []
    if not base.is_dir():
        return removed
    for root in sorted(base.iterdir()):
        if root.name.startswith(".new-"):
            if not owner_alive(root.name):
                if not dry_run:
                    if root.is_symlink():
                        root.unlink(missing_ok=True)
                    else:
                        remove_copy(root)
                removed.append(root.name)
            continue
        if root.is_symlink():  # an alias: gone with the last container labelled with it
            if root.name.startswith(ALIAS_PREFIX) and not _users(client, root.name):
                if not dry_run:
                    root.unlink(missing_ok=True)
                removed.append(root.name)
            continue
        fd = open_dir(root)
        if fd is None:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # a fork is being made from it
                raise
            # under the lock: an alias made by a fork in flight exists by now (``make_alias``)
            if any(_users(client, name) for name in (root.name, *aliases_of(base, root.name))):
                continue
            if not dry_run:
                _remove(root)
            removed.append(root.name)
        finally:
            os.close(fd)
    link_dir = Path(docker_root) / "overlay2" / "l"
    with contextlib.suppress(OSError):
        if dry_run:
            return removed
        for link in link_dir.glob(f"{LINK_PREFIX}*"):
            if link.is_symlink() and not link.exists():  # its copy is gone (a killed sweep)
                link.unlink(missing_ok=True)
    return removed


_swept_at_exit: set[str] = set()
_at_exit_lock = threading.Lock()


def sweep_at_exit(client: docker.DockerClient, docker_root: str | Path) -> None:
    """Sweep once more as this process exits (registered once per Docker root): closing the
    last fork of a copy removes its container, not the copy, which only the next fork's sweep
    or ``belayer gc`` would remove; a copy unpacked in memory holds RAM until then."""
    key = str(docker_root)
    with _at_exit_lock:
        if key in _swept_at_exit:
            return
        _swept_at_exit.add(key)
    atexit.register(_sweep_quietly, client, docker_root)


def _sweep_quietly(client: docker.DockerClient, docker_root: str | Path) -> None:
    with contextlib.suppress(Exception):  # the daemon may be gone: ``belayer gc`` removes it then
        sweep(client, docker_root)


def _users(client: docker.DockerClient, name: str) -> list[dict[str, Any]]:
    with translate_errors("list the forks of a shared layer"):
        return client.api.containers(all=True, filters={"label": f"{LABEL}={name}"})


def _remove(root: Path) -> None:
    with contextlib.suppress(OSError):
        link = (root / LINK_FILE).read_text().strip()
        if link.startswith(LINK_PREFIX):
            (root.parent.parent / "overlay2" / "l" / link).unlink(missing_ok=True)
    (root / READY).unlink(missing_ok=True)  # never used again, even if the removal stops halfway
    dead = root.with_name(f".new-dead-{uuid.uuid4().hex[:8]}~{owner_tag()}")
    try:
        os.rename(root, dead)
    except OSError:
        dead = root
    remove_copy(dead)
