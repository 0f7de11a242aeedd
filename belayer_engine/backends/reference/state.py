"""A worker's non-HTTP half: attach to the arena, map its memory, build model and engine.

A shadow runs everything up to (not including) serving: arena attached and mapped, model
built over the weight slot, a warm-up forward against the *scratch* KV blocks. It never
touches the live KV until :meth:`WorkerState.activate`, which takes the arena's live-KV
lease (refused while the old worker is still alive), resets the block table (the logical
KV flush) and starts the scheduler. Needs only torch (no aiohttp, no pydantic at import).
"""

from __future__ import annotations

import os
import threading
import time

import torch

from belayer_core.errors import ArenaLost
from belayer_engine.arena import memory as mem
from belayer_engine.arena.client import ArenaClient
from belayer_engine.backends.reference.model import Qwen3Model, SeqBatch
from belayer_engine.backends.reference.scheduler import BatchScheduler
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.tokenizer import load_tokenizer
from belayer_engine.model.weights import torch_dtype


class WorkerState:
    """State machine: shadow -> active (one way). ``arena_ok`` turns False if the arena dies."""

    def __init__(self, arena_socket: str, worker_id: str, shadow: bool, threads: int = 1,
                 max_running: int = 32, max_prefill_tokens: int = 1024,
                 exact: bool | None = None, tokenizer_dir: str | None = None,
                 graph_max_context: int = 2048):
        t0 = time.perf_counter()
        if threads > 0:
            torch.set_num_threads(threads)
        self.worker_id, self.pid = worker_id, os.getpid()
        self.state = "shadow" if shadow else "active"
        self.arena_ok = True
        self.lock = threading.Lock()  # the scheduler's creation vs a version pushed meanwhile
        self._activation = threading.Lock()
        self.scheduler: BatchScheduler | None = None
        self._early: tuple[int, int] | None = None  # a version pushed before the engine exists
        self.client = ArenaClient(arena_socket)
        self.attachment = self.client.attach("shadow" if shadow else "active", worker_id,
                                             self._on_version, self._on_lost)
        info = self.attachment.info
        self.info = info
        self.cfg = ModelConfig(**info["model"])
        self.device = torch.device(info["device"])
        self.regions = {n: mem.map_region(h) for n, h in info["regions"].items()}
        dtype = torch_dtype(self.cfg.dtype)
        self.slots = [mem.weight_views(self.regions[s], info["layout"], dtype)
                      for s in ("w0", "w1")]
        kvi = info["kv"]
        self.block_size = kvi["block_size"]
        self.num_blocks = kvi["num_blocks"]
        self.kv = mem.kv_view(self.regions["kv"], self.cfg,
                              self.num_blocks + kvi["scratch_blocks"], self.block_size)
        self.scratch_blocks = list(range(self.num_blocks, self.num_blocks + kvi["scratch_blocks"]))
        exact = self.device.type == "cpu" if exact is None else exact
        self.model = Qwen3Model(self.cfg, self.slots[info["slot"]], exact, self.device)
        self.tokenizer = load_tokenizer(tokenizer_dir, self.cfg.vocab_size)
        self.scheduler = BatchScheduler(self.model, self.tokenizer, self.block_size, max_running,
                             max_prefill_tokens)
        self.scheduler.on_version = self.attachment.confirm
        self.scheduler.set_weights(info["version"], self.slots[info["slot"]])
        with self.lock:
            if self._early is not None:
                self.scheduler.set_weights(self._early[0], self.slots[self._early[1]])
        self.warmup()
        if self.device.type == "cuda" and graph_max_context > 0:
            from belayer_engine.backends.reference.graphs import GraphRunner

            self.scheduler.graphs = GraphRunner(self.model, self.kv,
                                             -(-graph_max_context // self.block_size),
                                             self.scratch_blocks[0])
            self.scheduler.graphs.capture()
        if not shadow:
            self.scheduler.attach_kv(self.kv, self.num_blocks)
            self.scheduler.start()
        self.init_s = time.perf_counter() - t0

    @property
    def weight_version(self) -> int:
        return self.scheduler.version

    def _on_version(self, version: int, slot: int) -> None:
        with self.lock:
            if self.scheduler is None:
                self._early = (version, slot)
                return
        self.scheduler.set_weights(version, self.slots[slot])

    def _on_lost(self) -> None:
        self.arena_ok = False

    def warmup(self) -> None:
        """One forward pass on scratch KV blocks: first-call costs paid, live KV untouched."""
        n = min(4, self.block_size * len(self.scratch_blocks))
        self.model.forward(torch.zeros(n, dtype=torch.long), torch.arange(n),
                           [SeqBatch(0, n, n, self.scratch_blocks)], self.kv)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def activate(self) -> float:
        """Shadow -> active; returns seconds taken. Raises UsageError if the lease is held.

        Not under ``self.lock``: the arena's reply to acquire_kv can queue behind a weight
        version pushed meanwhile, whose handler (on the attachment's reader thread) takes that
        lock. Held here, activation and weight update waited on each other until the request's
        30 s timeout, and the handover fell back to a cold start (seen in a CI run)."""
        t0 = time.perf_counter()
        with self._activation:
            if self.state == "active":
                return 0.0
            if not self.arena_ok:
                raise ArenaLost("arena connection lost; cannot activate")
            self.attachment.acquire_kv()
            self.scheduler.attach_kv(self.kv, self.num_blocks)
            self.scheduler.start()
            self.state = "active"
        return time.perf_counter() - t0

    def close(self) -> None:
        self.scheduler.stop()
        self.attachment.close()
