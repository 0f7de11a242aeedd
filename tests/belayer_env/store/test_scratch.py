"""``scratch``: the capture scratch root becomes its own large-folio tmpfs, once, never over
anyone's files; its lock is never another user's to plant or hold (issue 47, item 7)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from belayer_core.errors import CheckpointFailed, ConfigError
from belayer_core.procfs import mounts
from belayer_env.store import in_memory, scratch
from tests.belayer_env.store.as_nobody import NobodyHolds, as_nobody

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


# ---------------------------------------------------------------- another user in /dev/shm

PLANT_LINK = "import os, sys; os.symlink(sys.argv[1], sys.argv[2])"
HOLD_LOCK = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666); "
             "fcntl.flock(fd, fcntl.LOCK_EX)")
OLD_LOCK = ".belayer-scratch.lock"
"""The name the lock file had beside the scratch root, in the shared directory."""


@pytest.fixture
def symlinks_followed():
    """``fs.protected_symlinks=0``, under which root follows another user's link in a sticky
    directory (this host's setting; set for the test and put back where it was 1)."""
    knob = Path("/proc/sys/fs/protected_symlinks")
    old = knob.read_text().strip()
    if old != "0":
        try:
            knob.write_text("0")
        except OSError as e:
            pytest.skip(f"fs.protected_symlinks is {old} and cannot be set to 0 here ({e.strerror})")
    yield
    if old != "0":
        knob.write_text(old)


@pytest.fixture
def shm(public_dir):
    """A sticky directory anyone may write, like /dev/shm; unmounts what a test mounted in it."""
    d = public_dir / "shm"
    d.mkdir()
    os.chmod(d, 0o1777)
    yield d
    for m in list(mounts()):
        if m.target.startswith(f"{public_dir}/"):
            in_memory.umount(Path(m.target))


@pytest.mark.parametrize("call", ["prepare", "new_dir"])
def test_a_link_planted_where_the_lock_was_is_never_followed(shm, public_dir, symlinks_followed, call):
    root = shm / "belayer-scratch"
    (public_dir / "root-only").mkdir(mode=0o755)
    target = public_dir / "root-only" / "planted"
    as_nobody(PLANT_LINK, str(target), str(shm / OLD_LOCK))
    if call == "prepare":
        assert scratch.prepare(root) and scratch.is_mounted(root)
    else:
        root.mkdir(mode=0o700)  # a plain scratch root (not mounted): new_dir locks
        assert scratch.new_dir(root, "ck~1-2").is_dir()
    assert not target.exists(), "root created a file where another user's link pointed"


def test_another_users_lock_holder_does_not_stall_the_mount(shm):
    root = shm / "belayer-scratch"
    done: dict[str, object] = {}
    with NobodyHolds(HOLD_LOCK, str(shm / OLD_LOCK)) as holder:
        worker = threading.Thread(target=lambda: done.update(mounted=scratch.prepare(root)), daemon=True)
        worker.start()
        worker.join(60)  # a bound for a hang: nothing of nobody's is waited for
        if worker.is_alive():
            holder.release()
            worker.join(60)
            pytest.fail("prepare waited for as long as another user held a lock of its choosing")
    assert done == {"mounted": True} and scratch.is_mounted(root)


def test_a_scratch_root_planted_as_a_link_is_refused_not_mounted_over(shm, public_dir, symlinks_followed):
    victim = public_dir / "victim"
    victim.mkdir(mode=0o755)
    as_nobody(PLANT_LINK, str(victim), str(shm / "belayer-scratch"))
    with pytest.raises(ConfigError, match="symlink"):
        scratch.prepare(shm / "belayer-scratch")
    assert _mounts_at(victim) == 0, "a tmpfs was mounted where another user's link pointed"


HOLD_OURS = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from belayer_env.store import scratch
with scratch.lock(Path(sys.argv[2]), exclusive=True):
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_a_lock_held_past_the_bound_is_a_typed_error_naming_path_and_holder(shm, monkeypatch):
    root = shm / "belayer-scratch"
    root.mkdir(mode=0o700)
    repo = str(Path(__file__).resolve().parents[3])
    holder = subprocess.Popen([sys.executable, "-c", HOLD_OURS, repo, str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        monkeypatch.setattr(scratch, "LOCK_WAIT_S", 0.2)
        with pytest.raises(scratch.ScratchLockBusy) as info:
            scratch.new_dir(root, "ck~1-2")
        assert isinstance(info.value, CheckpointFailed)
        assert str(root) in str(info.value) and f"pid {holder.pid}" in str(info.value), str(info.value)
        assert not (root / "ck~1-2").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert scratch.new_dir(root, "ck~1-2").is_dir()  # released: on it goes
