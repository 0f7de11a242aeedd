"""What the KV hook knows in this SGLang process: its role, its journal, the worker it
follows or took over from, and SGLang's objects it works on (set as SGLang builds them)."""

from __future__ import annotations

import os
import sys

import belayer_kv_journal as jr

# /resume_memory_occupation tags (backend.py sends them): adopt that server's journaled
# requests; only answer (the adoption's status)
ADOPT_TAG, STATUS_TAG = "belayer_adopt:", "belayer_status"


class _State:
    sid = os.environ.get("BELAYER_KV_SID", "")
    role = os.environ.get("BELAYER_KV_ROLE", "worker")
    gate_timeout_s = float(os.environ.get("BELAYER_KV_GATE_TIMEOUT_S", "60"))
    attached: dict | None = None
    journal: jr.Journal | None = None
    source: dict | None = None  # the worker this server follows (shadow) or took over from
    source_journal: jr.Journal | None = None
    source_table: object = None  # the source's request-to-token table, mapped once (CUDA IPC costs ms)
    r2t = None  # this server's ReqToTokenPool
    allocator = None
    rows = 0
    reserve = 0
    promoted = False
    pending_adoption = None  # the adoption answered but not yet run: run once this pass's inputs are in
    gather_until: float | None = None  # perf_counter: hold the continuations' first batch until then at most
    adopted_reserve = None  # the old reserve, kept for clear() before the gate opens
    journaled = False  # the first journal write is logged once
    adopted_at: float | None = None  # perf_counter at the adoption's end, until its first batch
    first_arrival: float | None = None  # perf_counter: the first request after the adoption reached the scheduler
    first_launch: float | None = None  # perf_counter: the first batch after the adoption was launched
    first_as_decode: bool = False  # that batch ran as the dead server's next decode step
    continuations: list = []  # (prompt length, committed, token ids) of each adopted row, until re-sent
    continued = 0  # adopted continuations run as a decode step since the adoption
    continuations_until = 0.0  # time.monotonic() after which the ones not re-sent are forgotten
    adoption_end: float | None = None  # perf_counter at the adoption's end (kept while continuations are awaited)
    arrivals: list = []  # ms after the adoption at which requests reached the scheduler, not yet logged
    loop_passes = 0  # scheduler loop passes between the adoption and the first request after it
    loop_gap = 0.0  # the longest time between two of those passes (s)
    loop_last: float | None = None


S = _State()


def say(msg: str) -> None:
    print(f"belayer kv: {msg}", file=sys.stderr, flush=True)


def row_of(req):
    """The request's row of the request-to-token table: on the request in SGLang 0.5.17 (whose
    ``req.kv`` is another record), on its ``kv`` record in 0.5.23."""
    if hasattr(req, "req_pool_idx"):
        return req.req_pool_idx
    return getattr(getattr(req, "kv", None), "req_pool_idx", None)


def source_reaped() -> bool:
    """The server this one took over from (or followed, cold) is gone: reaped by the supervisor."""
    return bool(S.source_journal is not None and S.source_journal.header[jr.H_REAPED])
