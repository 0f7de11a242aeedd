"""Trust boundaries of stores and replicas (issue 36, items 1-3 and 8): a replica, a store or
a manifest never writes outside its place; a store another user could change is refused.

No container is needed here: the checkpoints are directories written as a store writes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
from pathlib import Path

import pytest

from belayer_core.errors import CheckpointNotFound, ConfigError
from belayer_env.store.manifest import MANIFEST, read_manifest, write_manifest
from belayer_env.store.replica import MARKER_SUFFIX, ReplicaLocation
from belayer_env.store.replica_auth import KEY_ENV, ReplicaKey, new_key
from belayer_env.store.store import CheckpointStore

NOBODY = 65534


def _sha(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _checkpoint_dir(parent: Path, sandbox: str = "sb-trust", step: int = 1) -> Path:
    """A published-looking checkpoint: a layer file and a manifest naming it."""
    ck_id = f"{sandbox}.{step:06d}.{uuid.uuid4().hex[:8]}"
    d = parent / sandbox / ck_id
    d.mkdir(parents=True, mode=0o700)
    layer = b"not really a tar, never unpacked here"
    (d / "layer.tar").write_bytes(layer)
    write_manifest(d, {"id": ck_id, "sandbox": sandbox, "step": step, "created": 1.0, "frozen_s": 0.0,
                       "total_s": 0.0, "size_bytes": len(layer), "has_runtime": False, "config": {},
                       "files": {"layer.tar": {"size": len(layer), "sha256": _sha(layer)}}})
    return d


def _tamper(location: ReplicaLocation, rep_id: str, sandbox: str, evil_rel: str, *, sign: bool) -> None:
    """What a writer of the shared location can do: add an entry to a replica's manifest and
    fix the marker's sha256 (``sign``: and re-sign it, as a holder of the key could)."""
    base = Path(location.root) / sandbox / rep_id
    data = json.loads((base / MANIFEST).read_bytes())
    payload = b"planted"
    data["files"][evil_rel] = {"size": len(payload), "sha256": _sha(payload)}
    raw = json.dumps(data).encode()
    (base / MANIFEST).write_bytes(raw)
    marker_path = Path(location.root) / sandbox / f"{rep_id}{MARKER_SUFFIX}"
    marker = json.loads(marker_path.read_bytes())
    marker["manifest_sha256"] = _sha(raw)
    marker.pop("hmac")
    if sign:
        marker["hmac"] = location.key.sign(marker)
    marker_path.write_text(json.dumps(marker))


@pytest.mark.parametrize("evil", ["/tmp/belayer-evil-{}", "runtime//tmp/belayer-evil-{}",
                                  "lnk/../../../tmp/belayer-evil-{}", "runtime/../../../../tmp/belayer-evil-{}"])
@pytest.mark.parametrize("sign", [False, True], ids=["rehashed", "resigned"])
def test_a_replica_never_writes_outside_its_staging(tmp_path, evil, sign):
    tag = uuid.uuid4().hex[:8]
    evil_rel = evil.format(tag)
    target = Path(f"/tmp/belayer-evil-{tag}")
    src = _checkpoint_dir(tmp_path / "node-a")
    loc = ReplicaLocation((tmp_path / "shared").as_uri())
    rep = loc.upload(src)
    _tamper(loc, rep.id, rep.sandbox, evil_rel, sign=sign)
    store = CheckpointStore(tmp_path / "node-b", scratch=tmp_path / "scratch")
    with pytest.raises(CheckpointNotFound, match="refused|signed") as info:
        loc.fetch(rep.id, store)
    assert ("not signed" in str(info.value)) != sign  # an unsigned marker is refused before its manifest is read
    assert not target.exists(), "the replica wrote outside the store"
    assert store.list() == [] and not any((store.path / ".staging").iterdir())


def test_an_unsigned_or_foreign_replica_is_refused_and_not_listed(tmp_path):
    loc = ReplicaLocation((tmp_path / "shared").as_uri())
    rep = loc.upload(_checkpoint_dir(tmp_path / "node-a"))
    other_key = new_key(tmp_path / "other.key")
    foreign = ReplicaLocation((tmp_path / "shared").as_uri(), key_file=other_key)
    assert [r.id for r in loc.list()] == [rep.id]
    assert foreign.list() == []
    with pytest.raises(CheckpointNotFound, match="wrong signature"):
        foreign.get(rep.id)


def test_a_marker_naming_a_path_as_its_sandbox_is_a_clear_refusal(tmp_path):
    loc = ReplicaLocation((tmp_path / "shared").as_uri())
    rep = loc.upload(_checkpoint_dir(tmp_path / "node-a"))
    marker_path = Path(loc.root) / rep.sandbox / f"{rep.id}{MARKER_SUFFIX}"
    marker = json.loads(marker_path.read_bytes())
    marker["sandbox"] = "../../.."
    marker.pop("hmac")
    marker["hmac"] = loc.key.sign(marker)
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(CheckpointNotFound, match="not a plain name"):
        loc.fetch(rep.id, CheckpointStore(tmp_path / "node-b", scratch=tmp_path / "scratch"))


@pytest.mark.parametrize("planted", ["sbA.000008.eeee", "{b}"], ids=["another-id", "same-id-another-sandbox"])
def test_a_marker_copied_under_another_name_answers_for_nothing(tmp_path, planted):
    """Issue 47, item 5: copying B's signed marker into A's place (no key needed) must not
    make A's name fetch, list or prune B's checkpoint."""
    loc = ReplicaLocation((tmp_path / "shared").as_uri())
    rep_a = loc.upload(_checkpoint_dir(tmp_path / "node-a", "sbA", 1), episode={"task": "A's"})
    rep_b = loc.upload(_checkpoint_dir(tmp_path / "node-a", "sbB", 1), episode={"task": "B's"})
    planted = planted.format(b=rep_b.id)
    root = Path(loc.root)
    shutil.copy(root / "sbB" / f"{rep_b.id}{MARKER_SUFFIX}", root / "sbA" / f"{planted}{MARKER_SUFFIX}")
    store = CheckpointStore(tmp_path / "node-b", scratch=tmp_path / "scratch")
    if planted != rep_b.id:  # a name of its own: asking for it is refused, naming the mismatch
        with pytest.raises(CheckpointNotFound, match="marker of"):
            loc.fetch(planted, store)
        with pytest.raises(CheckpointNotFound, match="marker of"):
            loc.episode(planted)
        assert store.list() == []
    assert [r.id for r in loc.list("sbA")] == [rep_a.id]
    assert sorted(r.id for r in loc.list()) == sorted([rep_a.id, rep_b.id])
    assert loc.remove_sandbox("sbA", keep=rep_a.id) == []  # a resumed A prunes only A's replicas
    assert [r.id for r in loc.list("sbB")] == [rep_b.id]
    assert loc.episode(rep_b.id) == {"task": "B's"} and loc.fetch(rep_b.id, store).sandbox == "sbB"


def test_a_replica_key_that_is_a_fifo_is_refused_at_once(tmp_path):
    """Issue 47, item 8: a key path that is a FIFO blocked ``ReplicaLocation`` forever."""
    fifo = tmp_path / "replica.key"
    os.mkfifo(fifo, 0o600)
    outcome: dict[str, BaseException] = {}

    def load() -> None:
        try:
            ReplicaLocation((tmp_path / "shared").as_uri(), key_file=fifo)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = e

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(60)  # a bound for a hang, not a wait for something: the refusal needs no I/O
    if loader.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # release it: the writer opens and closes
        loader.join(60)
        pytest.fail("loading a replica key that is a FIFO blocked (until a writer came)")
    assert isinstance(outcome.get("error"), ConfigError), outcome
    assert "not a regular file (a FIFO)" in str(outcome["error"]) and str(fifo) in str(outcome["error"])


def test_replica_keys_must_be_private_and_given(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ConfigError, match="replicas are authenticated"):
        ReplicaLocation((tmp_path / "shared").as_uri())
    loose = new_key(tmp_path / "loose.key")
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match="0600"):
        ReplicaKey.load(loose)
    short = tmp_path / "short.key"
    short.write_text("too short")
    os.chmod(short, 0o600)
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        ReplicaKey.load(short)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another user")
def test_a_store_or_scratch_owned_by_another_user_is_refused(tmp_path):
    theirs = tmp_path / "belayer-checkpoints"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        CheckpointStore(theirs)
    assert os.stat(theirs).st_uid == NOBODY  # left as found
    scratch = tmp_path / "their-scratch"
    scratch.mkdir(mode=0o755)
    os.chown(scratch, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="scratch directory"):
        CheckpointStore(tmp_path / "mine", scratch=scratch)


def test_a_store_writable_by_others_is_refused(tmp_path):
    open_store = tmp_path / "open"
    open_store.mkdir()
    os.chmod(open_store, 0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        CheckpointStore(open_store)
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    CheckpointStore(readable)
    assert os.stat(readable).st_mode & 0o777 == 0o700  # ours: narrowed, not refused


def test_a_symlinked_checkpoint_directory_is_not_a_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path / "store", scratch=tmp_path / "scratch")
    real = _checkpoint_dir(store.path)
    decoy_id = f"sb-trust.000009.{uuid.uuid4().hex[:8]}"
    (store.path / "sb-trust" / decoy_id).symlink_to(real)
    assert [c.id for c in store.list("sb-trust")] == [real.name]
    with pytest.raises(CheckpointNotFound):
        store.get(decoy_id)


def test_a_local_manifest_with_a_path_entry_is_refused(tmp_path):
    store = CheckpointStore(tmp_path / "store", scratch=tmp_path / "scratch")
    d = _checkpoint_dir(store.path)
    data = read_manifest(d)
    data["files"]["runtime//etc/belayer-evil"] = {"size": 1, "sha256": "0" * 64}
    write_manifest(d, {k: v for k, v in data.items() if k != "format"})
    with pytest.raises(CheckpointNotFound, match="not a checkpoint artifact"):
        store.get(d.name)
    assert store.list() == []
