"""What ``belayer gc`` removes of containerd's copies of restored checkpoints, and what it keeps.

A copy is removed only when Belayer's nonce in it names an owner process that is gone (or,
written by an older Belayer without an owner, once it is far older than any restore);
a live restore's copy and a copy that is not Belayer's (no nonce) are kept. The copies
here are made in containerd's real temp dir; real restores' copies are checked in
``test_restore_paths`` (each restore removes its own; a SIGKILLed one's goes with gc).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from belayer_env.restore import ctrd_copies
from belayer_env.store.store import owner_tag

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def containerd_tmp():
    dirs = ctrd_copies.temp_dirs()
    if not dirs:
        pytest.skip("no containerd process visible (Docker not running here, or not root)")
    made: list[Path] = []

    def make(nonce: str | None, age_s: float = 0.0) -> Path:
        d = dirs[0] / f"{ctrd_copies.PREFIX}-belayer-test-{uuid.uuid4().hex[:8]}"
        d.mkdir(mode=0o700)
        (d / "pages-1.img").write_bytes(b"\0" * 4096)
        if nonce is not None:
            (d / ctrd_copies.NONCE_FILE).write_text(nonce)
        if age_s:
            os.utime(d, (time.time() - age_s, time.time() - age_s))
        made.append(d)
        return d

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def _dead_owner_tag() -> str:
    """The owner tag of a process that has exited."""
    out = subprocess.run([sys.executable, "-c", "from belayer_env.store.store import owner_tag; "
                          "print(owner_tag())"], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    return out.stdout.strip()


def test_gc_removes_only_copies_of_dead_restores(containerd_tmp):
    dead = containerd_tmp(f"{uuid.uuid4().hex}~{_dead_owner_tag()}")
    alive = containerd_tmp(f"{uuid.uuid4().hex}~{owner_tag()}")
    foreign = containerd_tmp(None, age_s=10 * ctrd_copies.LEGACY_AGE_S)  # not Belayer's: no nonce
    legacy_old = containerd_tmp(uuid.uuid4().hex, age_s=2 * ctrd_copies.LEGACY_AGE_S)
    legacy_young = containerd_tmp(uuid.uuid4().hex)

    listed = ctrd_copies.sweep(dry_run=True)
    assert dead in listed and legacy_old in listed, listed
    assert not {alive, foreign, legacy_young} & set(listed)
    assert dead.exists() and legacy_old.exists(), "a dry run removed something"

    removed = ctrd_copies.sweep()
    assert {dead, legacy_old} <= set(removed)
    assert not dead.exists() and not legacy_old.exists()
    assert alive.exists() and foreign.exists() and legacy_young.exists()


def test_remove_takes_exactly_the_copy_with_that_nonce(containerd_tmp):
    mine, other = f"{uuid.uuid4().hex}~{owner_tag()}", f"{uuid.uuid4().hex}~{owner_tag()}"
    a, b = containerd_tmp(mine), containerd_tmp(other)  # two restores of one checkpoint at once (fork)
    assert ctrd_copies.remove(mine) == [a]
    assert not a.exists() and b.exists()


def test_nonce_names_this_process_as_owner(tmp_path):
    nonce = ctrd_copies.write_nonce(tmp_path)
    assert (tmp_path / ctrd_copies.NONCE_FILE).read_text() == nonce
    assert nonce.endswith(f"~{owner_tag()}") and nonce != ctrd_copies.write_nonce(tmp_path)


def test_a_nonce_file_is_read_bounded_and_never_through_a_link(containerd_tmp, tmp_path):
    """The temp dir may be /tmp: another user's huge or linked "nonce" is not Belayer's."""
    huge = containerd_tmp(None)
    (huge / ctrd_copies.NONCE_FILE).write_bytes(b"a" * (1 << 20))  # no owner in the bounded read
    linked = containerd_tmp(None)
    secret = tmp_path / "secret"
    secret.write_text(f"{uuid.uuid4().hex}~{_dead_owner_tag()}")
    (linked / ctrd_copies.NONCE_FILE).symlink_to(secret)
    found = dict(ctrd_copies.copies())
    assert len(found[huge]) == ctrd_copies.NONCE_MAX and found[linked] == ""
    ctrd_copies.sweep()
    assert huge.exists() and linked.exists() and secret.exists()
