"""Inside an SGLang server: its KV pool and request table are the arena's, its journal says
what a successor may adopt, and promotion adopts the dead server's in-flight requests.

Installed by this folder's ``sitecustomize`` when ``BELAYER_KV_ARENA`` is set. What it
changes in SGLang (0.5.17 on the GPU, 0.5.23 on CPU; the same names in both), each by
wrapping one method as its module is imported:

- ``KVCacheConfigurator._profile_available_bytes``: the pool is not this process's memory,
  so its size is ``--max-total-tokens`` alone (the engine sets it), never what is free here;
- ``ReqToTokenPool``: the table is the arena's (``__init__``); a row freed or cleared is
  invalidated in the journal first (``free_rows`` / ``free``, ``clear``);
- ``MHATokenToKVPool._create_buffers_normal``: K and V of every layer are views of the
  arena's pool (``[layers, 2, rows, heads, head_dim]``; K and V of a layer are the two
  halves of one block, as SGLang 0.5.23 lays them out itself);
- ``TokenToKVPoolAllocator``: ``clear`` / ``alloc`` / ``available_size`` follow
  ``belayer_kv_slots`` (which slots this server may take, and when);
- ``SchedulerBatchResultProcessor.process_batch_result_{prefill,decode}``: after SGLang
  processed a batch's results (its forward is complete), each running request's row is
  journaled: its token ids and how many positions have complete KV;
- ``SchedulerWeightUpdaterManager.resume_memory_occupation``: the tag ``belayer_adopt:<sid>``
  is answered at once and adopts server ``sid``'s journaled requests into this server's
  radix cache (the KV stays where it is) as soon as ``Scheduler.process_input_requests``
  has taken in that pass's inputs, before any batch is formed; ``belayer_status`` only
  answers. Other tags go to SGLang.
- ``TpModelWorker.forward_batch_generation``: a batch of adopted continuations' one-token
  prefills runs as the decode step the dead server would have run (``belayer_kv_continue``);
  ``Scheduler._get_new_batch_prefill_raw`` forms no prefill batch while the adopted
  requests are still arriving (at most 25 ms after the first), so they take their first
  step together;
- ``Scheduler.handle_generate_request`` / ``process_input_requests``,
  ``TokenizerManager.generate_request`` / ``resume_memory_occupation`` and the HTTP
  server's app (one ASGI middleware) only note when the re-sent requests arrived
  (``belayer_kv_timeline``: log lines).

The allocator's patch is ``belayer_kv_alloc``, the journal writer ``belayer_kv_writer``,
adoption ``belayer_kv_adopt``; what this process knows is ``belayer_kv_state``. Nothing here
may stop the scheduler: an adoption that fails is logged and adopts nothing (the router
then re-prefills, as without it).
"""

from __future__ import annotations

import time

import belayer_kv_adopt
import belayer_kv_alloc
import belayer_kv_arena as arena
import belayer_kv_continue
import belayer_kv_journal as jr
import belayer_kv_timeline
import belayer_kv_writer
from belayer_kv_state import S, row_of, say

HUGE_BUDGET = 1 << 50  # bytes: the user's --max-total-tokens caps the pool, nothing else


# ---------------------------------------------------------------------- sizing
def patch_configurator(module) -> None:
    cls = module.KVCacheConfigurator

    def _profile_available_bytes(self, pre_model_load_memory):
        return HUGE_BUDGET

    cls._profile_available_bytes = _profile_available_bytes


# ---------------------------------------------------------------------- pool and table
def patch_memory_pool(module) -> None:
    r2t_cls, kv_cls = module.ReqToTokenPool, module.MHATokenToKVPool
    init = r2t_cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if S.r2t is None:
            S.r2t = self

    r2t_cls.__init__ = __init__
    _wrap_row_frees(r2t_cls)
    create = kv_cls._create_buffers_normal

    def _create_buffers_normal(self):
        if getattr(self, "kv_cache_layout", "nhd") not in ("nhd", None) or getattr(self, "use_hnd", False):
            raise RuntimeError(f"belayer kv: KV layout {self.kv_cache_layout!r} is not served by the arena (nhd only)")
        if self.page_size != 1:
            raise RuntimeError(f"belayer kv: page size {self.page_size}; the arena's pool needs --page-size 1")
        if S.r2t is None:
            raise RuntimeError("belayer kv: SGLang built the KV pool before its request table (unsupported version)")
        _attach(self)

    kv_cls._create_buffers_normal = _create_buffers_normal
    kv_cls._belayer_original_create = create


def _attach(kv) -> None:
    import torch

    store = kv.store_dtype
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(store)
    if dtype is None:
        raise RuntimeError(f"belayer kv: KV dtype {store} is not served by the arena (bf16, fp16 or fp32 only)")
    if kv.head_dim != kv.v_head_dim:
        raise RuntimeError("belayer kv: K and V head dims differ; not served by the arena")
    table = S.r2t.req_to_token
    asked = {"sid": S.sid, "role": S.role, "table": list(table.shape),
             "pool": {"layers": kv.layer_num, "heads": kv.head_num, "head_dim": kv.head_dim, "dtype": dtype,
                      "tokens": kv.size}}
    deadline = time.monotonic() + S.gate_timeout_s * 10
    while True:  # a shadow started beside the slot's first worker waits for that worker to attach
        try:
            reply = arena.call("kv_attach", **asked)
            break
        except arena.NoWorkerYet:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    pool = arena.tensor(reply["pool_handle"])
    spec = reply["pool"]
    if tuple(pool.shape) != (kv.layer_num, 2, spec["rows"], kv.head_num, kv.head_dim) or pool.dtype != store:
        raise RuntimeError(f"belayer kv: the arena's pool {tuple(pool.shape)} {pool.dtype} does not fit this server")
    if pool.device.type != torch.device(kv.device).type:
        raise RuntimeError(f"belayer kv: the arena's pool is on {pool.device}, this server on {kv.device}")
    kv.k_buffer = [pool[i, 0] for i in range(kv.layer_num)]
    kv.v_buffer = [pool[i, 1] for i in range(kv.layer_num)]
    # The pool is larger than SGLang's allocator by the reserve; the KV cache object itself
    # describes the buffers it holds (SGLang 0.5.23 checks rows == size + page size).
    kv.size = int(spec["rows"]) - 1
    arena_table = arena.tensor(reply["table_handle"])
    if arena_table.shape != table.shape or arena_table.dtype != table.dtype:
        raise RuntimeError("belayer kv: the arena's request table does not fit this server")
    S.r2t.req_to_token = arena_table
    S.attached, S.rows, S.reserve = reply, int(spec["rows"]), int(reply["reserve_tokens"])
    S.journal = jr.open_journal(reply["journal"])
    S.source = reply.get("predecessor")
    if S.source:  # a shadow maps what it may adopt now, not at the failure
        S.source_journal = jr.open_journal(S.source["journal"])
        S.source_table = arena.tensor(S.source["table_handle"])
        t0 = time.perf_counter()
        try:
            belayer_kv_adopt.warm_kernels(kv.device)
            say(f"adoption kernels warmed in {1e3 * (time.perf_counter() - t0):.1f} ms")
        except Exception as exc:  # only a warm-up: the adoption itself reports what fails
            say(f"adoption kernels not warmed: {type(exc).__name__}: {exc}")
    say(f"{S.role} {S.sid}: KV pool of {spec['rows'] - 1} slots ({spec['nbytes'] / 2**20:.0f} MiB) in the arena, "
         f"reserve {S.reserve}, follows {S.source['sid'] if S.source else None}")


def _wrap_row_frees(cls) -> None:
    """A row's journal entry goes before SGLang frees the row (finished, aborted, retracted)."""
    if hasattr(cls, "free_rows"):
        free_rows = cls.free_rows

        def free_rows_(self, indices):
            if self is S.r2t and S.journal is not None and len(indices):
                S.journal.invalidate(list(indices))
            return free_rows(self, indices)

        cls.free_rows = free_rows_
    else:
        free = cls.free

        def free_(self, req):
            row = row_of(req)
            if self is S.r2t and S.journal is not None and row is not None:
                S.journal.invalidate([row])
            return free(self, req)

        cls.free = free_
    clear = cls.clear

    def clear_(self):
        if self is S.r2t and S.journal is not None:
            S.journal.invalidate(slice(None))
        return clear(self)

    cls.clear = clear_

PATCHES = {
    "sglang.srt.mem_cache.kv_cache_configurator": patch_configurator,
    "sglang.srt.mem_cache.memory_pool": patch_memory_pool,
    "sglang.srt.mem_cache.allocator.token": belayer_kv_alloc.patch_allocator,
    "sglang.srt.managers.scheduler_components.batch_result_processor": belayer_kv_writer.patch_results,
    "sglang.srt.managers.scheduler_components.weight_updater": belayer_kv_adopt.patch_weight_updater,
    "sglang.srt.managers.tp_worker": belayer_kv_continue.patch_tp_worker,
    "sglang.srt.managers.scheduler": belayer_kv_continue.patch_scheduler,
    "sglang.srt.managers.tokenizer_manager": belayer_kv_timeline.patch_tokenizer_manager,
    "sglang.srt.entrypoints.http_server": belayer_kv_timeline.patch_http_server,
}
