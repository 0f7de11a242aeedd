"""The journal of one SGLang server whose KV lives in the arena: what its successor adopts.

A host shared-memory file the arena creates (mode 0600) and the server writes, read by the
shadow that takes over when the server dies. Numpy only, so the same module runs in the
project (the arena) and in SGLang's interpreter (the server's hook).

Layout (little-endian, one file):
- header, int64[16]: magic, layout version, rows, cols, reserve length, ``REAPED`` (the
  arena sets it once the server's whole process group is gone: none of its kernels or
  threads can write the pool again), ``RESERVE_READY`` (the arena sets it once the
  ``reserve`` below may be used by this server's successor), weights version in force.
- reserve, int64[reserve length]: KV slots this server never allocates; its shadow warms up
  in them and, once promoted, allocates only there until this server is reaped.
- meta, int64[rows, 5]: per request row ``seq`` (odd while the row is being written),
  ``committed`` (tokens whose KV is written and complete), the weights ``version`` the row's
  KV was computed with, ``written`` (``committed`` as of the last write that finished: set
  after ``seq`` is even again, so a row whose writer died inside a write is still good up
  to there; a write only appends past it), ``prompt`` (the request's input length: the
  positions from there on were generated, each one the input of a decode step).
- tokens, int32[rows, cols]: the token ids of each row's committed positions.

The KV slot of each committed position is not here: it is in the server's request-to-token
table, which the arena also holds (the server's kernels write it; it survives the server).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

MAGIC = 0x42454C4B56  # "BELKV"
LAYOUT = 2
HEADER = 16
H_MAGIC, H_LAYOUT, H_ROWS, H_COLS, H_RESERVE, H_REAPED, H_RESERVE_READY, H_VERSION = range(8)
H_ADOPTED_ROWS, H_ADOPTED_TOKENS = 8, 9  # what this server adopted at its promotion (-1: adoption failed)
M_SEQ, M_COMMITTED, M_VERSION, M_WRITTEN, M_PROMPT = range(5)
META = 5


def nbytes(rows: int, cols: int, reserve: int) -> int:
    return 8 * (HEADER + reserve + rows * META) + 4 * rows * cols


class Journal:
    """Numpy views of one journal file (created by :func:`create`, mapped by :func:`open_journal`)."""

    def __init__(self, path: str, buf: mmap.mmap):
        self.path, self._buf = path, buf
        head = np.frombuffer(buf, dtype=np.int64, count=HEADER)
        if int(head[H_MAGIC]) != MAGIC or int(head[H_LAYOUT]) != LAYOUT:
            raise ValueError(f"{path}: not a Belayer KV journal (layout {LAYOUT})")
        rows, cols, reserve = (int(head[i]) for i in (H_ROWS, H_COLS, H_RESERVE))
        if len(buf) < nbytes(rows, cols, reserve):
            raise ValueError(f"{path}: {len(buf)} bytes, shorter than its header says")
        self.header = head
        self.rows, self.cols = rows, cols
        offset = 8 * HEADER
        self.reserve = np.frombuffer(buf, dtype=np.int64, count=reserve, offset=offset)
        offset += 8 * reserve
        self.meta = np.frombuffer(buf, dtype=np.int64, count=rows * META, offset=offset).reshape(rows, META)
        offset += 8 * rows * META
        self.tokens = np.frombuffer(buf, dtype=np.int32, count=rows * cols, offset=offset).reshape(rows, cols)

    # ------------------------------------------------------------------ the server writes
    def begin(self, rows) -> None:
        """Mark ``rows`` as being written (odd ``seq``): a reader never trusts them now."""
        self.meta[rows, M_SEQ] |= 1

    def end(self, rows) -> None:
        self.meta[rows, M_SEQ] += 1  # even again, and different from before the write

    def publish(self, rows, ends, version: int, prompts) -> None:
        """Close a write begun by ``begin`` whose tokens up to ``ends`` are in place
        (``prompts``: each row's input length; only positions past it count as generated)."""
        self.meta[rows, M_COMMITTED] = ends
        self.meta[rows, M_PROMPT] = prompts
        self.meta[rows, M_VERSION] = version
        self.end(rows)
        self.meta[rows, M_WRITTEN] = ends  # last: while odd, a reader trusts only the previous write

    def invalidate(self, rows) -> None:
        """Rows whose KV is freed (request finished, aborted, retracted, cache flushed)."""
        self.meta[rows, M_WRITTEN] = 0  # first: a reader that finds the row odd takes nothing
        self.begin(rows)
        self.meta[rows, M_COMMITTED] = 0
        self.end(rows)

    # ------------------------------------------------------------------ the successor reads
    def stable_rows(self) -> list[tuple[int, int, int]]:
        """``(row, committed, version)`` of every row with committed KV; a row its writer died
        inside counts only up to its last finished write (what the dying write appended, and
        the token whose KV it may have been writing, are never read)."""
        meta = self.meta.copy()
        writing = meta[:, M_SEQ] % 2 == 1
        good = np.where(writing, meta[:, M_WRITTEN], meta[:, M_COMMITTED])
        return [(int(row), int(good[row]), int(meta[row, M_VERSION])) for row in np.nonzero(good > 0)[0]]

    def cut_rows(self) -> int:
        """Rows a write was in progress in (they count up to the write before it)."""
        return int(((self.meta[:, M_SEQ] % 2 == 1) & (self.meta[:, M_WRITTEN] > 0)).sum())

    def row_tokens(self, row: int, committed: int, seq_before: int) -> np.ndarray | None:
        """A copy of the row's committed token ids, None if the row changed while copied."""
        ids = self.tokens[row, :committed].copy()
        return ids if int(self.meta[row, M_SEQ]) == seq_before else None

    def close(self) -> None:
        self.header = self.reserve = self.meta = self.tokens = None
        try:
            self._buf.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass


def create(path: str, rows: int, cols: int, reserve: int, version: int) -> Journal:
    """A new zeroed journal at ``path`` (mode 0600, never through an existing file or link)."""
    size = nbytes(rows, cols, reserve)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    head = np.frombuffer(buf, dtype=np.int64, count=HEADER)
    head[[H_MAGIC, H_LAYOUT, H_ROWS, H_COLS, H_RESERVE, H_VERSION]] = [MAGIC, LAYOUT, rows, cols, reserve, version]
    del head
    return Journal(path, buf)


def open_journal(path: str) -> Journal:
    """Map an existing journal read-write (the owner uid only: the arena made it 0600)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() and os.getuid() != 0:
            raise ValueError(f"{path}: owned by uid {st.st_uid}, not this user")
        buf = mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)
    return Journal(path, buf)
