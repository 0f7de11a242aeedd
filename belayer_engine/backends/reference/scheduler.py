"""Continuous batching over a paged KV arena.

One thread runs the loop: take new requests and aborts, switch to a newer weight version
if one was pushed (only between steps, so one step never mixes versions), admit waiting
requests while KV blocks last, then run one forward call holding every new request's
prompt rows and one decode row per running request, sample, and emit.

A request reserves the blocks for ``prompt + max_new_tokens`` when admitted, so a running
request never waits for memory and nothing is ever preempted.

An error inside one request (its sampling, its stop check, its rows of a forward call)
finishes that request alone with an ``abort`` carrying ``status_code`` (SGLang's shape:
400 for bad input, 500 otherwise) and frees its blocks; the rest of the batch goes on. When
a batched forward call fails, each request's rows are re-run alone (rewriting the same KV
positions), so only the request that breaks it is failed.

A request and its blocks are ``request.py``; a step's logits (CUDA graphs or eager) ``forward.py``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

import torch

from belayer_core.errors import UsageError
from belayer_engine.backends.reference.forward import eager_logits, graph_logits
from belayer_engine.backends.reference.model import Qwen3Model
from belayer_engine.backends.reference.request import BlockAllocator, Request
from belayer_engine.backends.reference.sampling import SamplingError, sample, token_logprobs
from belayer_engine.model.tokenizer import Tokenizer

__all__ = ["BatchScheduler", "BlockAllocator", "Request"]


class BatchScheduler:
    """The scheduler loop. Thread-safe entry points: submit, abort, flush, set_weights."""

    def __init__(self, model: Qwen3Model, tokenizer: Tokenizer, block_size: int,
                 max_running: int = 32, max_prefill_tokens: int = 1024):
        self.model, self.tok = model, tokenizer
        self.block_size = block_size
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.kv: torch.Tensor | None = None
        self.alloc = BlockAllocator(0)
        self.version = -1
        self.on_version: Callable[[int], None] = lambda v: None
        self.cond = threading.Condition()
        self.inbox: deque[Request] = deque()
        self.aborts: set[str] = set()
        self.pending_weights: tuple[int, dict] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.beat = time.monotonic()  # the loop's last sign of life (see stuck_s)
        self.graphs = None  # a cuda_graphs.GraphRunner on CUDA, else None (eager)

    # ------------------------------------------------------------------ control
    def attach_kv(self, kv: torch.Tensor, num_blocks: int | None = None) -> None:
        """Serve from ``kv`` blocks [0, num_blocks) with an empty block table (the logical
        KV flush); blocks past ``num_blocks`` are scratch and never handed out."""
        with self.cond:
            self.kv = kv
            self.alloc = BlockAllocator(kv.shape[2] if num_blocks is None else num_blocks)

    def set_weights(self, version: int, weights: dict) -> None:
        """Serve ``version`` from the next step on (immediately when idle)."""
        with self.cond:
            self.pending_weights = (version, weights)
            if self.thread is None:
                self._switch_weights()
            self.cond.notify_all()

    def _switch_weights(self) -> None:
        if self.pending_weights is not None:
            version, weights = self.pending_weights
            self.pending_weights = None
            if version > self.version:
                self.model.set_weights(weights)
                if self.graphs is not None:
                    self.graphs.capture()  # graphs bake in weight addresses: one set per slot
                self.version = version
                self.on_version(version)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop after its current step and wait (at most ``timeout``) for the thread:
        an engine thread still inside torch while the interpreter exits can abort the process."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def capacity_check(self, req: Request) -> None:
        """Reject what can never fit (a clear 400 instead of waiting forever)."""
        total = len(req.prompt) + req.params.max_new_tokens
        if total > self.model.cfg.max_position_embeddings:
            raise UsageError(f"prompt + max_new_tokens = {total} exceeds the model's "
                             f"{self.model.cfg.max_position_embeddings} positions")
        need = -(-total // self.block_size)
        if need > self.alloc.num_blocks:
            raise UsageError(f"prompt + max_new_tokens = {total} tokens needs {need} KV blocks; "
                             f"the arena has {self.alloc.num_blocks}")

    def submit(self, req: Request) -> None:
        self.capacity_check(req)
        with self.cond:
            self.inbox.append(req)
            self.cond.notify_all()

    def abort(self, rid: str | None) -> None:
        """Abort one request by id, or all of them when ``rid`` is None."""
        with self.cond:
            self.aborts.add("*" if rid is None else rid)
            self.cond.notify_all()

    def flush(self) -> bool:
        """Reset KV metadata; refused (False) while requests are in flight."""
        with self.cond:
            if self.running or self.waiting or self.inbox:
                return False
            self.alloc.reset()
            return True

    def stuck_s(self) -> float:
        """Seconds the loop has been inside one step with work pending (0 when idle): a hung
        scheduler behind a live HTTP server still shows up as unhealthy."""
        if not (self.running or self.waiting or self.inbox):
            return 0.0
        return time.monotonic() - self.beat

    def load(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting) + len(self.inbox),
                "free_blocks": len(self.alloc.free)}

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        while True:
            self.beat = time.monotonic()
            with self.cond:
                self.cond.wait_for(lambda: self.stopping or self.inbox or self.aborts
                                   or self.running or self.pending_weights is not None
                                   or (self.waiting and not self.running))
                if self.stopping:
                    return
                self._switch_weights()
                self.waiting.extend(self.inbox)
                self.inbox.clear()
                aborts, self.aborts = self.aborts, set()
            self.beat = time.monotonic()
            self._apply_aborts(aborts)
            try:
                self._step()
            except Exception as exc:  # a bug must not wedge the worker: fail the batch
                traceback.print_exc(file=sys.stderr)
                for r in list(self.running):
                    self._fail(r, exc)

    def _apply_aborts(self, aborts: set[str]) -> None:
        if not aborts:
            return
        reason = {"type": "abort", "message": "aborted by request"}
        for r in [*self.running, *self.waiting]:
            if "*" in aborts or r.rid in aborts:
                self._finish(r, reason)

    def _finish(self, r: Request, reason: dict) -> None:
        r.finish_reason = reason
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self.alloc.release(r.blocks)
        r.blocks = []
        self._emit(r)

    def _fail(self, r: Request, exc: BaseException) -> None:
        """End ``r`` alone with an error the router reports to its client (not a worker failure)."""
        bad_input = isinstance(exc, UsageError | SamplingError)
        self._finish(r, {"type": "abort", "message": f"request failed in the worker: {type(exc).__name__}: {exc}",
                         "status_code": 400 if bad_input else 500, "err_type": type(exc).__name__})

    def _emit(self, r: Request) -> None:
        ev = {"output_ids": list(r.output), "finish_reason": r.finish_reason,
              "weight_version": self.version, "weight_version_start": r.version_start}
        if r.logprobs is not None:  # cumulative, aligned with output_ids (SGLang's default stream)
            ev["logprobs"] = list(r.logprobs)
            ev["top_logprobs"] = None if r.top_logprobs is None else list(r.top_logprobs)
        r.emit(ev)

    def _admit(self) -> list[Request]:
        new, budget = [], self.max_prefill_tokens
        while self.waiting and len(self.running) + len(new) < self.max_running:
            r = self.waiting[0]
            if new and len(r.prompt) > budget:
                break
            blocks = self.alloc.alloc(-(-(len(r.prompt) + r.params.max_new_tokens)
                                        // self.block_size))
            if blocks is None:
                break
            self.waiting.popleft()
            r.blocks, r.version_start = blocks, self.version
            try:
                r.generator = r.params.generator()
            except Exception as exc:  # e.g. a seed torch refuses: this request alone
                self._fail(r, exc)
                continue
            budget -= len(r.prompt)
            if r.params.max_new_tokens == 0:
                self._finish(r, {"type": "length", "length": 0})
                continue
            new.append(r)
        return new

    def _step(self) -> None:
        new = self._admit()
        batch = self.running + new
        if not batch:
            return
        self.running.extend(new)
        try:
            logits = graph_logits(self.graphs, batch, new)
            if logits is None:
                logits = eager_logits(self.model, self.kv, batch, new)
            rows = list(zip(batch, logits, strict=True))
        except Exception:
            traceback.print_exc(file=sys.stderr)
            rows = self._one_by_one(batch, new)
        if not rows:
            return
        greedy = torch.stack([row for _, row in rows]).argmax(-1).tolist()  # one device sync
        for (r, row), best in zip(rows, greedy, strict=True):
            try:
                tok = best if r.params.greedy else sample(row, r.params, r.generator)
                r.output.append(tok)
                if r.logprobs is not None:
                    lp, top = token_logprobs(row, r.params, tok, r.top_logprobs_num)
                    r.logprobs.append(lp)
                    if r.top_logprobs is not None:
                        r.top_logprobs.append(top)
                reason = self._stop_reason(r, tok)
            except Exception as exc:
                self._fail(r, exc)
                continue
            if reason is not None:
                self._finish(r, reason)
            else:
                self._emit(r)

    def _one_by_one(self, batch: list[Request], new: list[Request]) -> list:
        """(request, logits) per request, each run alone: a request whose rows fail is failed alone."""
        rows = []
        for r in batch:
            try:
                rows.append((r, eager_logits(self.model, self.kv, [r], [r] if any(r is n for n in new) else [])[0]))
            except Exception as exc:
                self._fail(r, exc)
        return rows

    def _stop_reason(self, r: Request, tok: int) -> dict | None:
        p = r.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tok.eos_token_ids):
            return {"type": "stop", "matched": tok}
        if p.stop:
            text = self.tok.decode(r.output, skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s and s in text:
                    return {"type": "stop", "matched": s}
        if len(r.output) >= p.max_new_tokens:
            return {"type": "length", "length": len(r.output)}
        return None
