"""A replica's commit marker: what it says, how it is signed, and when it is believed.

Object stores have no atomic directory rename, so a replica is committed by one object
written last, ``<sandbox>/<id>.ready.json``, naming the sha256 of the replica's manifest
(and of its episode record). Whoever can write the location can write a marker, so each
carries an HMAC of its fields under the cluster's key (``replica_auth``), and it answers
only for the name it is stored under: a marker without a signature, with a wrong one, with
names that are not plain, or copied to another name, is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from belayer_env.store.names import check_plain, sandbox_of
from belayer_env.store.replica_auth import MAC_FIELD, ReplicaKey

MARKER_SUFFIX = ".ready.json"
EPISODE = "episode.json"
"""Beside the replica's artifacts: the episode record a resume needs (its sha256 in the marker)."""
FORMAT = 1


@dataclass(frozen=True)
class Replica:
    """A committed replica: what its marker says."""

    id: str
    sandbox: str
    step: int
    created: float
    manifest_sha256: str
    episode_sha256: str | None


def marker_path(root: str, sandbox: str, checkpoint_id: str) -> str:
    return f"{root}/{sandbox}/{checkpoint_id}{MARKER_SUFFIX}"


def signed(marker: Replica, key: ReplicaKey) -> bytes:
    """The marker's bytes: its fields, the format and the HMAC of both."""
    fields = {"format": FORMAT, **marker.__dict__}
    fields[MAC_FIELD] = key.sign(fields)
    return json.dumps(fields, sort_keys=True).encode()


def believed(raw: bytes, path: str, key: ReplicaKey) -> Replica:
    """The marker read from ``path``: one this cluster signed, naming plain names, at the place
    its id and sandbox give (``<sandbox>/<id>.ready.json``); ``ValueError`` otherwise."""
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a belayer replica marker (format {FORMAT})")
    mac = data.pop(MAC_FIELD, None)
    if not key.verify(data, mac):
        raise ValueError(f"{path} is not signed with this cluster's replica key "
                         f"({'no signature' if mac is None else 'wrong signature'}): refused")
    data.pop("format")
    rep = Replica(**data)
    if sandbox_of(rep.id) != check_plain("sandbox name", rep.sandbox):
        raise ValueError(f"{path}: checkpoint {rep.id!r} is not of sandbox {rep.sandbox!r}")
    # the signature covers id and sandbox, and they must name this very file: a marker
    # copied to another name (no key needed) answers for nothing
    if path.rsplit("/", 2)[-2:] != [rep.sandbox, f"{rep.id}{MARKER_SUFFIX}"]:
        raise ValueError(f"{path} is the marker of {rep.id!r} of sandbox {rep.sandbox!r}, copied to another "
                         "name: refused")
    return rep
