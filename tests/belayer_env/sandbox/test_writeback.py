"""``writeback.flush_later`` writes back what background work left dirty, off the caller's path.

The property: once ``wait_flushed`` returns, the data a call wrote is no longer dirty in
the page cache (so a later fsync by Docker or containerd does not wait for it).
"""

from __future__ import annotations

import os
from pathlib import Path

from belayer_env.sandbox import writeback

MIB = 1 << 20


def _dirty_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Dirty:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Dirty: line in /proc/meminfo")


def test_flush_later_writes_back_what_was_written(tmp_path):
    data = tmp_path / "image"
    with open(data, "wb") as f:
        for _ in range(64):
            f.write(os.urandom(MIB))
    dirty_before = _dirty_bytes()
    writeback.flush_later(tmp_path)
    assert writeback.wait_flushed(120), "write-back did not finish in 120 s"
    # other writers on the host may dirty pages meanwhile: the 64 MiB of ours must be gone
    assert _dirty_bytes() < max(dirty_before - 48 * MIB, 16 * MIB), (dirty_before, _dirty_bytes())


def test_flush_of_a_vanished_path_is_quiet(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    gone.rmdir()
    writeback.flush_later(gone, tmp_path)  # the second path is still written back
    assert writeback.wait_flushed(60)
