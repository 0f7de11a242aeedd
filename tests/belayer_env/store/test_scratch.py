"""``scratch``: the capture scratch root becomes its own large-folio tmpfs, once, never over
anyone's files."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from belayer_core.procfs import mounts
from belayer_env.store import in_memory, scratch

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
              pytest.mark.skipif(not in_memory.huge_supported(), reason="no transparent huge pages for shmem")]


def _mounts_at(path: Path) -> int:
    return sum(1 for m in mounts() if m.target == str(path))


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "belayer-scratch"
    yield r
    while _mounts_at(r):
        in_memory.umount(r)


def test_an_empty_root_is_mounted_once_with_large_folios(root):
    assert scratch.prepare(root)
    assert scratch.prepare(root)  # again: the same mount, not a second one over it
    assert _mounts_at(root) == 1
    assert in_memory.HUGE_OPTION in scratch.mount_options(root).split(",")
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    d = scratch.new_dir(root, "ck~1-2")
    assert d.is_dir() and oct(d.stat().st_mode & 0o777) == "0o700"
    assert scratch.is_mounted(root) and (root / "ck~1-2").is_dir()


def test_a_root_in_use_is_never_mounted_over(root):
    root.mkdir(mode=0o700)
    (root / "ck~123-456").mkdir()  # another process's capture, before any mount
    (root / "ck~123-456" / "pages-1.img").write_bytes(b"frozen memory")
    assert not scratch.prepare(root)
    assert _mounts_at(root) == 0
    assert (root / "ck~123-456" / "pages-1.img").read_bytes() == b"frozen memory"
    assert scratch.new_dir(root, "ck~7-8").is_dir()  # scratch still works, plain


def _prepare(path: str, q) -> None:
    q.put(scratch.prepare(Path(path)))


def test_concurrent_stores_mount_it_once(root):
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_prepare, args=(str(root), q)) for _ in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [q.get(timeout=10) for _ in procs] == [True] * 6
    assert _mounts_at(root) == 1, "stacked scratch mounts: one would hide the other's captures"
