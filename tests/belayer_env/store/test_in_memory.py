"""``in_memory``: real tmpfs mounts named by their maker, and unmounted even while busy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_core.procfs import mounts
from belayer_env.store import in_memory

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def _source_of(path: Path) -> str | None:
    return next((m.source for m in reversed(mounts()) if m.target == str(path)), None)


@pytest.mark.parametrize("source", [in_memory.FORK, in_memory.PRESTAGE, in_memory.RESTORE])
def test_the_mount_names_its_maker(tmp_path, source):
    d = tmp_path / "tree"
    d.mkdir()
    assert in_memory.try_mount_tmpfs(d, 1 << 20, source=source, mode="0700")
    try:
        assert _source_of(d) == source
        assert oct(d.stat().st_mode & 0o777) == "0o700"
    finally:
        in_memory.umount(d)
    assert _source_of(d) is None


def test_a_busy_mount_goes_lazily_and_its_user_keeps_reading(tmp_path):
    d = tmp_path / "tree"
    d.mkdir()
    assert in_memory.try_mount_tmpfs(d, 1 << 20, source=in_memory.FORK)
    (d / "f").write_text("unpacked")
    user = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); print(open('f').read())"],
                            cwd=d, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        in_memory.umount(d)  # busy (the user's cwd): plain umount fails, the lazy one detaches it
        assert _source_of(d) is None, "the busy tmpfs stayed mounted"
        out, _ = user.communicate("go\n", timeout=30)
        assert out.strip() == "unpacked"  # its memory goes with its last user, not before
    finally:
        user.kill()
        user.wait(timeout=30)
    in_memory.umount(d)  # not a mount point any more: nothing to do
    assert not (d / "f").exists()


def test_memory_cap_bounds():
    small = 1 << 20
    cap = in_memory.memory_cap(small)
    assert cap is None or cap == 4 * small + (16 << 20)
    if in_memory.LOWER_MODE != "memory":
        assert in_memory.memory_cap(in_memory.MEMORY_MAX_BYTES + 1) is None


@pytest.mark.skipif(not in_memory.huge_supported(), reason="no transparent huge pages for shmem on this kernel")
def test_large_folios_without_a_huge_page_per_small_file(tmp_path):
    """``huge=within_size``: large writes get large folios; 200 small files must not take
    2 MiB each (what ``huge=always`` costs), a layer's thousands of files stay affordable."""
    d = tmp_path / "tree"
    d.mkdir()
    assert in_memory.try_mount_tmpfs(d, 64 << 20, source=in_memory.FORK)
    try:
        options = next(m.options for m in reversed(mounts()) if m.target == str(d))
        assert in_memory.HUGE_OPTION in options.split(","), options
        for i in range(200):
            (d / f"small{i}").write_bytes(b"x" * 100)
        st = os.statvfs(d)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        assert used <= 200 * 16 * 1024, f"200 files of 100 bytes took {used} bytes of the tmpfs"
    finally:
        in_memory.umount(d)
