"""The journal writer: after SGLang processed a batch's results (its forward is complete),
each running request's row says which positions have complete KV and their token ids."""

from __future__ import annotations

import time

import belayer_kv_journal as jr
from belayer_kv_alloc import open_gate
from belayer_kv_state import S, row_of, say


def patch_results(module) -> None:
    cls = module.SchedulerBatchResultProcessor
    prefill, decode = cls.process_batch_result_prefill, cls.process_batch_result_decode

    def process_batch_result_prefill(self, batch, result, *args, **kwargs):
        middle = [getattr(r, "inflight_middle_chunks", 0) > 0 for r in batch.reqs]  # before SGLang counts them down
        out = prefill(self, batch, result, *args, **kwargs)
        if S.adopted_at is not None:
            _first_after_adoption(batch)
        _journal([r for r, mid in zip(batch.reqs, middle, strict=False) if not mid])
        return out

    def process_batch_result_decode(self, batch, result, *args, **kwargs):
        out = decode(self, batch, result, *args, **kwargs)
        _journal(batch.reqs)
        return out

    cls.process_batch_result_prefill = process_batch_result_prefill
    cls.process_batch_result_decode = process_batch_result_decode


def _first_after_adoption(batch) -> None:
    """Logged once: where the wait after an adoption goes (its first batch's results are
    the continuations' next tokens): the re-sent requests' arrival, the batch's launch, its
    results, each in ms after the adoption."""
    now = time.perf_counter()
    after = {name: None if t is None else 1e3 * (t - S.adopted_at)
             for name, t in (("arrived", S.first_arrival), ("launched", S.first_launch), ("results", now))}
    S.adopted_at = None
    cached = [int(getattr(r, "cached_tokens", 0) or 0) for r in batch.reqs]
    say(f"first batch after adoption: {len(batch.reqs)} requests, {getattr(batch, 'extend_num_tokens', '?')} "
        f"tokens prefilled ({'as a decode step' if S.first_as_decode else 'as an extend'}), {sum(cached)} from "
        f"the cache; ms after the adoption: " + ", ".join(f"{k} {v:.1f}" for k, v in after.items() if v is not None))


def _journal(reqs) -> None:
    """Each running request's complete KV: every position but the newest token's (its KV is
    written by the next forward, which may be running now)."""
    j = S.journal
    if j is None or S.allocator is None:
        return
    open_gate(S.allocator, wait=False)
    version = int(j.header[jr.H_VERSION])
    rows, starts, ends, fills = [], [], [], []
    for req in reqs:
        row = row_of(req)
        if row is None or req.finished():
            continue
        origin, output = req.origin_input_ids, req.output_ids
        committed = min(len(origin) + len(output) - 1, j.cols)
        written = int(j.meta[row, jr.M_WRITTEN])
        if written and int(j.meta[row, jr.M_VERSION]) != version:
            j.invalidate([row])  # computed with older weights: never adoptable
            continue
        if committed <= written:
            continue
        rows.append(row)
        starts.append(written)
        ends.append(committed)
        fills.append((origin, output))
    if not rows:
        return
    if not S.journaled:
        S.journaled = True
        say(f"journaling: first rows {rows[:4]} committed {ends[:4]} (version {version})")
    j.begin(rows)
    for row, start, end, (origin, output) in zip(rows, starts, ends, fills, strict=True):
        n = len(origin)
        if start < n:
            j.tokens[row, start:min(end, n)] = origin[start:min(end, n)]
        if end > n:
            j.tokens[row, max(start, n):end] = output[max(start, n) - n:end - n]
    j.publish(rows, ends, version, [len(origin) for origin, _ in fills])
