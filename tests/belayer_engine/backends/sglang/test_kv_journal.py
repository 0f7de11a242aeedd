"""The KV journal a server writes and its successor reads (``kv_hooks/belayer_kv_journal.py``),
with real writer processes killed by a real SIGKILL at the worst moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HOOKS = Path(__file__).resolve().parents[4] / "belayer_engine" / "backends" / "sglang" / "kv_hooks"
sys.path.insert(0, str(HOOKS))
import belayer_kv_journal as jr  # noqa: E402

WRITER = r"""
import os, sys
sys.path.insert(0, {hooks!r})
import belayer_kv_journal as jr
j = jr.open_journal({path!r})
done = os.fdopen({ready_fd}, "w")
# row 1: complete; row 2: complete, then rewritten and killed inside the write
for row, n in ((1, 5), (2, 7)):
    j.begin([row]); j.tokens[row, :n] = range(100 * row, 100 * row + n)
    j.publish([row], [n], 3, [2])
j.begin([2]); j.tokens[2, 7:9] = [-1, -1]; j.meta[[2], jr.M_COMMITTED] = 9
if {stage!r} == "invalidate":
    j.meta[[2], jr.M_WRITTEN] = 0; j.begin([2])  # inside an invalidation instead
done.write("inside\n"); done.flush()
sys.stdin.readline()  # killed here, between begin and end
"""


@pytest.fixture
def journal(tmp_path):
    j = jr.create(str(tmp_path / "journal"), rows=4, cols=16, reserve=3, version=3)
    yield j
    j.close()


def _kill_inside(journal, stage: str) -> None:
    read_fd, ready_fd = os.pipe()
    code = WRITER.format(hooks=str(HOOKS), path=journal.path, ready_fd=ready_fd, stage=stage)
    writer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, pass_fds=(ready_fd,))
    os.close(ready_fd)
    with os.fdopen(read_fd) as ready:
        assert ready.readline() == "inside\n"  # the writer is between begin and end of row 2
    os.kill(writer.pid, signal.SIGKILL)
    assert writer.wait(30) == -signal.SIGKILL


def test_a_row_its_writer_died_inside_counts_up_to_its_write_before(journal):
    """The client may see a token before the row that holds it is journaled (SGLang streams
    it first): a row cut by the kill keeps what its previous write published, never the
    positions the dying write was appending."""
    _kill_inside(journal, "append")
    rows = journal.stable_rows()
    assert rows == [(1, 5, 3), (2, 7, 3)], rows
    assert journal.cut_rows() == 1
    for row, n in ((1, 5), (2, 7)):
        seq = int(journal.meta[row, jr.M_SEQ])
        assert journal.row_tokens(row, n, seq).tolist() == list(range(100 * row, 100 * row + n))


def test_a_row_its_writer_died_inside_an_invalidation_is_never_adopted(journal):
    _kill_inside(journal, "invalidate")
    assert journal.stable_rows() == [(1, 5, 3)]


def test_a_row_changed_while_copied_is_refused(journal):
    journal.begin([1])
    journal.tokens[1, :3] = [7, 8, 9]
    journal.publish([1], [3], 3, [1])
    seq = int(journal.meta[1, jr.M_SEQ])
    journal.invalidate([1])  # freed (and maybe rewritten) after the reader took seq
    assert journal.row_tokens(1, 3, seq) is None
    assert journal.stable_rows() == []


def test_freed_rows_are_invalidated_and_a_cleared_pool_has_no_rows(journal):
    for row in (1, 2, 3):
        journal.begin([row])
        journal.publish([row], [row], 3, [1])
    journal.invalidate([2])
    assert [r for r, _, _ in journal.stable_rows()] == [1, 3]
    journal.invalidate(slice(None))
    assert journal.stable_rows() == []
    assert (journal.meta[:, jr.M_SEQ] % 2 == 0).all()


def test_the_file_is_private_and_never_made_through_a_link(tmp_path):
    target = tmp_path / "elsewhere"
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(FileExistsError):
        jr.create(str(tmp_path / "link"), rows=1, cols=1, reserve=1, version=0)
    assert not target.exists()
    j = jr.create(str(tmp_path / "j"), rows=2, cols=2, reserve=1, version=0)
    assert (os.stat(j.path).st_mode & 0o777) == 0o600
    j.close()


def test_a_file_that_is_not_a_journal_is_refused(tmp_path):
    bogus = tmp_path / "bogus"
    bogus.write_bytes(np.zeros(64, dtype=np.int64).tobytes())
    with pytest.raises(ValueError, match="not a Belayer KV journal"):
        jr.open_journal(str(bogus))
    short = jr.create(str(tmp_path / "short"), rows=4, cols=16, reserve=3, version=0)
    short.close()
    os.truncate(tmp_path / "short", 8 * jr.HEADER)
    with pytest.raises(ValueError, match="shorter than its header"):
        jr.open_journal(str(tmp_path / "short"))
