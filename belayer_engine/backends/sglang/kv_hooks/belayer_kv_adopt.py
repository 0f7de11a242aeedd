"""Adoption: on promotion, the shadow takes the dead server's journaled requests into its
radix cache. Their KV stays where the dead server wrote it, in the arena's pool, so the
router's re-sent ``prompt + generated`` ids are a cache hit and only the newest token is
prefilled. A row the dead server was writing at the kill counts up to its write before (the
token whose KV a kernel may have been writing is never trusted: it is prefilled again); a
row computed with older weights is skipped."""

from __future__ import annotations

import functools
import logging
import time
from array import array

import belayer_kv_arena as arena
import belayer_kv_continue as continuations
import belayer_kv_journal as jr
import belayer_kv_slots as slots
from belayer_kv_alloc import apply_plan
from belayer_kv_state import ADOPT_TAG, STATUS_TAG, S, say, source_reaped

log = logging.getLogger("belayer.kv")


def patch_weight_updater(module) -> None:
    cls = module.SchedulerWeightUpdaterManager
    resume = cls.resume_memory_occupation

    def resume_memory_occupation(self, recv_req):
        tags = list(recv_req.tags or [])
        ours = [t for t in tags if isinstance(t, str) and (t.startswith(ADOPT_TAG) or t == STATUS_TAG)]
        if not ours:
            return resume(self, recv_req)
        for tag in ours:
            if tag.startswith(ADOPT_TAG):
                # Answered at once, adopted right after this pass's inputs are taken in (the
                # scheduler's process_input_requests) and before any batch is formed: the
                # router's re-sent requests cross SGLang's HTTP side meanwhile (tens of ms on
                # a GPU, as long as the adoption's wait for the device).
                S.pending_adoption = functools.partial(adopt_or_nothing, self.scheduler, tag[len(ADOPT_TAG):])
        rest = [t for t in tags if t not in ours]
        if rest:
            recv_req.tags = rest
            return resume(self, recv_req)
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqOutput

        return ResumeMemoryOccupationReqOutput()

    cls.resume_memory_occupation = resume_memory_occupation


def adopt_or_nothing(scheduler, source_sid: str) -> None:
    try:
        _adopt(scheduler, source_sid)
    except Exception as exc:  # never the scheduler's end: adopt nothing, the router re-prefills
        log.exception("belayer kv: adoption failed")
        _undo(scheduler)
        say(f"adoption failed, nothing adopted: {type(exc).__name__}: {exc}")
        S.journal.header[jr.H_ADOPTED_ROWS:jr.H_ADOPTED_TOKENS + 1] = [-1, 0]


def bad_rows(flat, lengths: list[int], in_reserve, rows: int) -> list[bool]:
    """Per row of slots (``flat``: every row's slots end to end on the host, ``lengths`` each
    row's count): does any lie outside the pool or in the old reserve (``in_reserve``, a host
    bool array: never the dead server's own)? Checked on the host: on an H100 the same check
    as ten small device ops and a sync took 23-25 ms right after a kill."""
    import numpy as np

    if not lengths:
        return []
    flat = np.asarray(flat, dtype=np.int64)
    bad = (flat < 1) | (flat >= rows)
    inside = ~bad
    bad[inside] = in_reserve[flat[inside]]
    ends = np.cumsum(lengths)
    counts = np.concatenate(([0], np.cumsum(bad)))
    return [bool(counts[end] - counts[end - n]) for n, end in zip(lengths, ends, strict=True)]


def read_rows(table, rows: list[tuple[int, int]]):
    """The slots of each (row, committed) of the dead server's request table, end to end: on
    the device (one gather; the radix tree keeps views of it) and on the host (one copy: the
    only wait for the device until the plan's upload)."""
    import torch

    views = [table[row, :committed] for row, committed in rows]
    on_device = torch.cat(views).to(torch.int64) if views else table.new_zeros(0, dtype=torch.int64)
    return on_device, on_device.cpu().numpy()


def radix_key(ids):
    """SGLang's radix key for token ids from the journal (int32): one buffer copy, not a
    Python list of 8K ints."""
    import numpy as np
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", np.ascontiguousarray(ids, dtype=np.int64).tobytes()))


def first_device_op(device) -> float:
    """Seconds one tiny op takes to come back from the device, at the adoption's start:
    whether the device is still busy (the dead server's last kernels, its context's teardown)
    is then told apart from the adoption's own work in its log line (on an H100: 0.3-2.2 ms,
    so the adoption's slow part was not that)."""
    import torch

    t0 = time.perf_counter()
    torch.ones(1, device=device).add_(1).cpu()
    return time.perf_counter() - t0


def warm_kernels(device) -> None:
    """Run every kind of device op an adoption runs once, on tiny tensors, in a shadow that
    waits: on a GPU the first launch of each kernel loads its module (CUDA's lazy loading,
    milliseconds each), which would otherwise land inside the handover."""
    import numpy as np
    import torch

    first_device_op(device)
    table = torch.ones((2, 8), dtype=torch.int32, device=device)  # the request table's dtype
    on_device, flat = read_rows(table, [(0, 4), (1, 2)])
    on_device[:4].clone()  # the radix tree's copy of a row
    in_reserve = np.zeros(16, dtype=bool)
    in_reserve[[12, 13]] = True
    bad_rows(flat, [4, 2], in_reserve, 16)
    old_reserve = np.array([12, 13])
    own = slots.choose_reserve(16, 2, old_reserve, slots.unique(16, flat))
    slots.promoted_plan(16, old_reserve, slots.unique(16, flat[1:3]), own, device, lambda: False)
    slots.promoted_plan(16, old_reserve, slots.unique(16, flat[1:3]), own, device, lambda: True)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _undo(scheduler) -> None:
    """A failed adoption leaves nothing behind: an empty cache and the shadow's slots (what it
    inserted would otherwise be counted twice and stop SGLang's idle check)."""
    S.promoted, S.adopted_reserve = False, None
    scheduler.flush_cache()


def _adopt(scheduler, source_sid: str) -> None:
    """Take ``source_sid``'s journaled requests into this server's radix cache (their KV stays
    in the arena's pool), then allocate only where no kernel of the dead server can write."""
    import numpy as np
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    t0 = time.perf_counter()
    if S.promoted:
        raise RuntimeError("already promoted")
    if not S.source or S.source["sid"] != source_sid:
        S.source = arena.call("kv_source", sid=source_sid)["source"]
        if S.source is None:
            raise RuntimeError(f"the arena knows no server {source_sid!r}")
        S.source_journal = jr.open_journal(S.source["journal"])
        S.source_table = arena.tensor(S.source["table_handle"])
    src, table = S.source_journal, S.source_table
    t_source = time.perf_counter()
    if scheduler.tree_cache.evictable_size() or scheduler.tree_cache.protected_size():
        scheduler.flush_cache()  # an idle shadow keeps nothing of its own (registration flushed its warm-up)
    device = S.allocator.device
    old_reserve = slots.in_pool(S.rows, src.reserve.copy(), "the dead server's reserve")
    in_reserve = np.zeros(S.rows, dtype=bool)
    in_reserve[old_reserve] = True
    version = int(S.journal.header[jr.H_VERSION])
    in_tree, touched, adopted, tokens = [], [], [], 0
    page_size = max(1, int(getattr(scheduler.tree_cache, "page_size", 1)))
    cut = src.cut_rows()  # rows it was writing at the kill: adopted up to the write before
    skipped = {"version": 0, "changed": 0, "slots": 0}
    readable = []
    for row, committed, row_version in src.stable_rows():
        seq = int(src.meta[row, jr.M_SEQ])
        prompt = int(src.meta[row, jr.M_PROMPT])
        if row_version != version:
            skipped["version"] += 1  # KV of older weights
            continue
        if committed > table.shape[1]:
            skipped["slots"] += 1
            continue
        ids = src.row_tokens(row, committed, seq)
        if ids is None:
            skipped["changed"] += 1
            continue
        readable.append((prompt, committed, ids, row))
    t_read = time.perf_counter()
    device_wait = first_device_op(device)  # what the GPU makes it wait for, apart from the check
    on_device, flat = read_rows(table, [(r[3], r[1]) for r in readable])
    lengths = [r[1] for r in readable]
    untrusted = bad_rows(flat, lengths, in_reserve, S.rows)
    ends = np.cumsum(lengths, dtype=np.int64)
    for (prompt, committed, ids, _), bad, end in zip(readable, untrusted, ends.tolist(), strict=True):
        begin = end - committed
        if bad:
            skipped["slots"] += 1  # not slots the dead server could own: never trusted
            continue
        cached = scheduler.tree_cache.insert(InsertParams(key=radix_key(ids), value=on_device[begin:end]))
        # the tree keeps only slots past what it already held for these ids: two requests of one
        # prompt that each computed their own copy leave the second copy's slots to the allocator
        # (hidden until the reap, like every other slot the dead server may still write)
        aligned = committed // page_size * page_size
        in_tree.append(flat[begin + cached.prefix_len:begin + aligned])
        touched.append(flat[begin:end])
        adopted.append((prompt, committed, ids))
        tokens += committed
    rows_ok = len(adopted)
    t_rows = time.perf_counter()
    held = slots.unique(S.rows, *in_tree)
    own = slots.choose_reserve(S.rows, S.reserve, old_reserve, slots.unique(S.rows, *touched))
    S.journal.reserve[:] = own
    S.promoted, S.adopted_reserve = True, old_reserve
    apply_plan(S.allocator, slots.promoted_plan(S.rows, old_reserve, held, own, device, source_reaped))
    S.allocator.release_pages = S.allocator.free_pages[:0].clone()
    S.journal.header[jr.H_ADOPTED_ROWS:jr.H_ADOPTED_TOKENS + 1] = [rows_ok, tokens]
    t_plan = time.perf_counter()
    arena.call("kv_promoted", sid=S.sid, predecessor=source_sid)
    continuations.remember(adopted)
    S.first_arrival = S.first_launch = None
    S.first_as_decode = False
    t_end = S.adopted_at = time.perf_counter()
    ms = {"source": t_source - t0, "read": t_read - t_source, "first device op": device_wait,
          "rows": t_rows - t_read - device_wait, "plan": t_plan - t_rows, "arena": t_end - t_plan}
    say(f"adopted {rows_ok} requests ({tokens} tokens of KV, {held.size} slots) from {source_sid}, "
        f"{cut} cut to their write before the kill, skipped {skipped}, in {1e3 * (t_end - t0):.1f} ms "
        f"({', '.join(f'{k} {1e3 * v:.1f}' for k, v in ms.items())})")
