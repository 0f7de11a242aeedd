"""An adopted request's first step runs as the decode step the dead server would have run next.

The router re-sends ``prompt + generated`` ids; after an adoption all but the newest id are
a cache hit, so SGLang schedules a one-token prefill (extend). The dead server would have
computed that token in a decode step, and SGLang's extend and decode attention kernels sum
in different orders: in deterministic mode the continuation then drifts from the fault-free
ids a few tokens later. A batch whose every request is such a continuation (one new token,
at a generated position of an adopted row, no input-token logprobs) is run by the model as
a decode batch instead: the same kernels, the decode CUDA graph, the same numbers. The
scheduler still sees an extend batch (its bookkeeping and results are a prefill's).
"""

from __future__ import annotations

import time

import belayer_kv_timeline as timeline
from belayer_kv_state import S, say

TAIL = 64  # ids before the new token compared with the adopted row (the row is matched by SGLang's tree already)
# The router re-sends every in-flight request at the promotion; one not back by then never
# comes (its client left): forgotten, so prefills stop being matched and logged against it.
WAIT_S = 60.0
# The re-sent requests reach the scheduler over tens of ms (one by one through SGLang's HTTP
# side). Run at once, the first would take a step alone and the rest wait for it, then for
# the next (three steps of ~22 ms for 16 requests of 8K on an H100): the continuations'
# first batch waits until every adopted request is back, at most this long after the first.
# A decision on the clock: sound with one rank only (the arena's KV is refused at tp > 1,
# where every rank's scheduler must form the same batches).
GATHER_S = 0.025


def remember(entries: list[tuple[int, int, object]]) -> None:
    """``(prompt length, committed, token ids)`` of each adopted row."""
    S.continuations, S.continued, S.arrivals = list(entries), 0, []
    S.continuations_until = time.monotonic() + WAIT_S
    S.adoption_end = time.perf_counter()
    S.loop_passes, S.loop_gap, S.loop_last = 0, 0.0, None


def _match(ids, prefix: int) -> int | None:
    """Index of the adopted row whose generated position ``prefix`` this request's new token is."""
    for i, (prompt, committed, row_ids) in enumerate(S.continuations):
        if prompt <= prefix <= committed and prefix >= 1:
            lo = max(0, prefix - TAIL)
            if list(ids[lo:prefix]) == row_ids[lo:prefix].tolist():
                return i
    return None


def continues_adopted(batch) -> bool:
    """Every request of ``batch`` is an adopted continuation's first step (then consumed).
    A prefill batch that is not says why in the log while continuations are pending."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if batch.forward_mode != ForwardMode.EXTEND or not batch.reqs:
        if batch.reqs and not batch.forward_mode.is_decode_or_idle():
            say(f"a batch of {len(batch.reqs)} requests runs as {batch.forward_mode.name}, not as a decode step")
        return False
    why = _not_a_continuation(batch)
    if why:
        say(f"a prefill of {len(batch.reqs)} requests runs as an extend: {why}")
        return False
    return True


def _not_a_continuation(batch) -> str | None:
    spec = getattr(batch, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        return "speculative decoding"
    extend, prefix = batch.extend_lens, batch.prefix_lens
    if extend is None or prefix is None or any(int(n) != 1 for n in extend):
        return f"new ids per request {list(extend or [])[:8]}"
    starts = batch.extend_logprob_start_lens
    if batch.return_logprob and starts is not None and any(int(s) != int(n) for s, n in zip(starts, extend, strict=False)):
        return "input-token logprobs asked"  # a prefill's output
    if any(getattr(r, "multimodal_inputs", None) is not None for r in batch.reqs):
        return "multimodal inputs"
    found = [_match(r.origin_input_ids, int(p)) for r, p in zip(batch.reqs, prefix, strict=True)]
    if any(i is None for i in found):
        return f"not at a generated position of an adopted row (cached {list(prefix)[:8]})"
    for i in sorted(set(found), reverse=True):
        del S.continuations[i]
    return None


def patch_tp_worker(module) -> None:
    cls = module.TpModelWorker
    forward = cls.forward_batch_generation

    def forward_batch_generation(self, batch=None, *args, **kwargs):
        if S.adopted_at is not None and S.first_launch is None:
            S.first_launch = time.perf_counter()
        if S.continuations and time.monotonic() > S.continuations_until:
            say(f"{len(S.continuations)} adopted requests not re-sent within {WAIT_S:.0f} s: no longer awaited")
            S.continuations = []
        if batch is None or not S.continuations or not continues_adopted(batch):
            return forward(self, batch, *args, **kwargs)
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        mode, batch.forward_mode = batch.forward_mode, ForwardMode.DECODE
        try:
            out = forward(self, batch, *args, **kwargs)
        except Exception as exc:  # this SGLang's decode path refuses an extend's batch: prefill it, as without
            S.continuations = []
            say(f"adopted continuations prefilled instead: the decode step failed: {type(exc).__name__}: {exc}")
            out = None
        finally:
            batch.forward_mode = mode
        if out is None:
            return forward(self, batch, *args, **kwargs)
        if S.adopted_at is not None:
            S.first_as_decode = True
        S.continued += len(batch.reqs)
        arrived, S.arrivals = S.arrivals, []
        say(f"adopted continuations run as a decode step: {len(batch.reqs)} requests ({S.continued} since the "
            f"adoption, {len(S.continuations)} to come); requests arrived since the last step at "
            f"{_ms_list(arrived)} ms after the adoption")
        return out

    cls.forward_batch_generation = forward_batch_generation


def _ms_list(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.0f}" for v in values) + "]"


def holding(waiting: int) -> bool:
    """Hold the continuations' first batch: adopted requests are still on their way (fewer
    than are awaited wait in the queue) and the first came less than ``GATHER_S`` ago."""
    if S.gather_until is None:
        return False
    if S.continuations and waiting < len(S.continuations) and time.perf_counter() < S.gather_until:
        return True
    held = 1e3 * (time.perf_counter() - S.gather_until + GATHER_S)
    say(f"continuations gathered for {held:.1f} ms: {waiting} requests waiting, {len(S.continuations)} adopted awaited")
    S.gather_until = None
    return False


def patch_scheduler(module) -> None:
    """The adoption answered in this pass runs once the pass's inputs are taken in; the
    continuations' first batch is gathered (``holding``); when requests after an adoption
    reach the scheduler (the log's timeline): the first one, and each one while adopted
    continuations are awaited."""
    cls = module.Scheduler
    handle, take_in = cls.handle_generate_request, cls.process_input_requests
    prefill = getattr(cls, "_get_new_batch_prefill_raw", None)

    def process_input_requests(self, *args, **kwargs):
        timeline.note_scheduler_pass()
        out = take_in(self, *args, **kwargs)
        adopt, S.pending_adoption = S.pending_adoption, None
        if adopt is not None:
            adopt()
        return out

    def handle_generate_request(self, recv_req, *args, **kwargs):
        if timeline.is_health_check(getattr(recv_req, "rid", None)):  # SGLang's /health, not a client's
            return handle(self, recv_req, *args, **kwargs)
        now = time.perf_counter()
        if S.adopted_at is not None and S.first_arrival is None:
            S.first_arrival = now
            S.gather_until = now + GATHER_S if S.continuations else None
            timeline.log_first_arrival()
        if S.continuations and S.adoption_end is not None:
            S.arrivals.append(1e3 * (now - S.adoption_end))
        return handle(self, recv_req, *args, **kwargs)

    def _get_new_batch_prefill_raw(self, *args, **kwargs):
        running = kwargs.get("running_batch", args[-1] if args else None)
        if holding(len(self.waiting_queue)):
            return None, running
        return prefill(self, *args, **kwargs)

    cls.handle_generate_request = handle_generate_request
    cls.process_input_requests = process_input_requests
    if prefill is None:
        say("continuations not gathered: this SGLang's Scheduler has no _get_new_batch_prefill_raw")
    else:
        cls._get_new_batch_prefill_raw = _get_new_batch_prefill_raw
