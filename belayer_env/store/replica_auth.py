"""Who may write a replica: the nodes that hold the cluster's replica key.

A replica location is shared (a bucket, an NFS directory): anyone who can write there can
put a checkpoint in it, and its commit marker's sha256 only catches accidents, since a
writer rewrites it too. So every marker carries an HMAC-SHA256, under a key the cluster's
nodes share, of the marker's fields (which name the manifest's sha256, and the manifest
names every file's): a node restores only replicas made with its key. The key is a file of
at least 32 random bytes, owned by the user and readable by no one else (0600); its path
is ``ReplicaLocation(key_file=...)`` or ``$BELAYER_REPLICA_KEY_FILE``.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from belayer_core.errors import ConfigError

KEY_ENV = "BELAYER_REPLICA_KEY_FILE"
MIN_KEY_BYTES = 32
MAX_KEY_FILE_BYTES = 4096
MAC_FIELD = "hmac"


def new_key(path: str | os.PathLike[str]) -> Path:
    """Write a fresh key (64 hex characters, 0600) to a new file ``path``; copy it to every node."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


class ReplicaKey:
    """The cluster's replica key: signs the markers this node writes, checks the ones it reads."""

    def __init__(self, secret: bytes):
        if len(secret) < MIN_KEY_BYTES:
            raise ConfigError(f"a replica key needs at least {MIN_KEY_BYTES} bytes, got {len(secret)}")
        self._secret = secret

    @classmethod
    def load(cls, key_file: str | os.PathLike[str] | None) -> ReplicaKey:
        """The key in ``key_file`` (default ``$BELAYER_REPLICA_KEY_FILE``): a private file of this user."""
        raw_path = key_file if key_file is not None else os.environ.get(KEY_ENV)
        if not raw_path:
            raise ConfigError(
                "replicas are authenticated: give ReplicaLocation(key_file=PATH) (or set "
                f"${KEY_ENV}) naming a file of at least {MIN_KEY_BYTES} random bytes, mode 0600, that every node "
                "of the cluster shares (make one: python3 -c 'from belayer_env.store.replica_auth import "
                "new_key; new_key(\"PATH\")')")
        path = Path(raw_path)
        try:  # O_NONBLOCK: a FIFO (or a device) put where the key belongs opens at once, to be refused
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(f"replica key {path} is a symlink: refused (name the key file itself)") from e
            if e.errno == errno.ENXIO:
                raise ConfigError(f"replica key {path} is not a regular file (a socket): refused") from e
            raise ConfigError(f"replica key {path}: {e.strerror}") from e
        try:
            st = os.fstat(fd)  # of what was opened: nothing swapped in between
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"replica key {path} is not a regular file ({_kind(st.st_mode)}): refused")
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ConfigError(f"replica key {path} must be owned by this user and private (mode 0600), "
                                  f"is uid {st.st_uid} mode {stat.S_IMODE(st.st_mode):04o}")
            if st.st_size > MAX_KEY_FILE_BYTES:
                raise ConfigError(f"replica key {path} holds {st.st_size} bytes, more than a key file's "
                                  f"{MAX_KEY_FILE_BYTES}: refused")
            secret = _read_at_most(fd, MAX_KEY_FILE_BYTES).strip()
        finally:
            os.close(fd)
        return cls(secret)

    def sign(self, fields: dict[str, Any]) -> str:
        return hmac.new(self._secret, _canonical(fields), hashlib.sha256).hexdigest()

    def verify(self, fields: dict[str, Any], mac: object) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(self.sign(fields), mac)


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, left = [], limit
    while left > 0 and (chunk := os.read(fd, left)):
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return f"file type {stat.S_IFMT(mode):o}"
