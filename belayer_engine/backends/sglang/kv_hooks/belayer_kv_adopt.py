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


def bad_rows(slot_rows, in_reserve, rows: int) -> list[bool]:
    """Per row of slots: does any lie outside the pool or in the old reserve (``in_reserve``,
    a host bool array: never the dead server's own)? One copy of every row to the host,
    checked there: on an H100 the same check as ten small device ops and a sync took
    23-25 ms right after a kill (device work came back slowly then; why is not known)."""
    import numpy as np
    import torch

    if not slot_rows:
        return []
    flat = torch.cat(slot_rows).cpu().numpy()
    bad = (flat < 1) | (flat >= rows)
    inside = ~bad
    bad[inside] = in_reserve[flat[inside]]
    ends = np.cumsum([len(r) for r in slot_rows])
    counts = np.concatenate(([0], np.cumsum(bad)))
    return [bool(counts[end] - counts[end - len(r)]) for r, end in zip(slot_rows, ends, strict=True)]


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
    idx = table[0, :4].to(device=device, dtype=torch.int64) + torch.arange(4, device=device)
    old_reserve = torch.tensor([12, 13], dtype=torch.int64, device=device)
    in_reserve = np.zeros(16, dtype=bool)
    in_reserve[[12, 13]] = True
    bad_rows([idx, idx[:2]], in_reserve, 16)
    held = torch.unique(torch.cat([idx[1:3], idx[:2]]))
    everything = torch.unique(torch.cat([idx, idx]))
    own = slots.choose_reserve(16, 2, old_reserve, everything, device)
    own.cpu().numpy()
    slots.promoted_plan(16, old_reserve, held, own, device, lambda: False)
    slots.promoted_plan(16, old_reserve, held, own, device, lambda: True)
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
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

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
    old_reserve = torch.from_numpy(src.reserve.copy()).to(device)
    in_reserve = np.zeros(S.rows, dtype=bool)
    in_reserve[src.reserve] = True
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
        readable.append((prompt, committed, ids, table[row, :committed].to(device=device, dtype=torch.int64)))
    t_read = time.perf_counter()
    device_wait = first_device_op(device)  # what the GPU makes it wait for, apart from the check
    untrusted = bad_rows([r[3] for r in readable], in_reserve, S.rows)
    for (prompt, committed, ids, idx), bad in zip(readable, untrusted, strict=True):
        if bad:
            skipped["slots"] += 1  # not slots the dead server could own: never trusted
            continue
        cached = scheduler.tree_cache.insert(InsertParams(key=RadixKey(array("q", ids.tolist())), value=idx.clone()))
        # the tree keeps only slots past what it already held for these ids: two requests of one
        # prompt that each computed their own copy leave the second copy's slots to the allocator
        # (hidden until the reap, like every other slot the dead server may still write)
        aligned = committed // page_size * page_size
        in_tree.append(idx[cached.prefix_len:aligned])
        touched.append(idx)
        adopted.append((prompt, committed, ids))
        tokens += committed
    rows_ok = len(adopted)
    t_rows = time.perf_counter()
    held = torch.unique(torch.cat(in_tree)) if in_tree else old_reserve[:0]
    everything = torch.unique(torch.cat(touched)) if touched else old_reserve[:0]
    own = slots.choose_reserve(S.rows, S.reserve, old_reserve, everything, device)
    S.journal.reserve[:] = own.cpu().numpy()
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
    say(f"adopted {rows_ok} requests ({tokens} tokens of KV, {held.numel()} slots) from {source_sid}, "
        f"{cut} cut to their write before the kill, skipped {skipped}, in {1e3 * (t_end - t0):.1f} ms "
        f"({', '.join(f'{k} {1e3 * v:.1f}' for k, v in ms.items())})")
