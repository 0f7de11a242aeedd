"""CUDA graphs for decode steps and prompt prefills (CUDA only; CPU uses the exact eager path).

Graphs are captured for a few batch sizes (decode) and prompt lengths (prefill of one
sequence, padded up to the next captured length) against the arena's KV tensor, with
every block-table slot pointing at a scratch block, so capturing (e.g. in a shadow) never
writes a live block; the live blocks share the tensor, so the graphs stay valid after
activation. Weights' addresses are baked in too, so each weight slot gets its own set
(captured when that slot is first served). A prefill graph replaces thousands of
eagerly launched kernels (30-40 ms of host time for a Qwen3-4B-shaped model on an H200,
against ~8-12 ms replayed): it is what makes the re-prefill after a handover cheap.
"""

from __future__ import annotations

import torch

from belayer_engine.backends.reference import ops
from belayer_engine.backends.reference.model import Qwen3Model

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)
PREFILL_SIZES = (64, 256, 1024)


class GraphRunner:
    """Replays the captured decode graph of the smallest batch size that fits."""

    def __init__(self, model: Qwen3Model, kv: torch.Tensor, max_blocks: int, scratch_block: int,
                 sizes: tuple[int, ...] = DEFAULT_SIZES,
                 prefill_sizes: tuple[int, ...] = PREFILL_SIZES):
        self.model, self.kv = model, kv
        self.sizes = tuple(sorted(sizes))
        self.prefill_sizes = tuple(sorted(prefill_sizes))
        self.max_blocks, self.scratch = max_blocks, scratch_block
        self.block_size = kv.shape[3]
        dev, bmax = model.device, self.sizes[-1]
        self.ids = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.pos = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.tables = torch.full((bmax, max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.ctx = torch.ones(bmax, dtype=torch.long, device=dev)
        pmax = self.prefill_sizes[-1] if self.prefill_sizes else 0
        self.p_ids = torch.zeros(pmax, dtype=torch.long, device=dev)
        self.p_pos = torch.arange(pmax, dtype=torch.long, device=dev)  # prompts start at 0
        self.p_blk = torch.full((pmax,), scratch_block, dtype=torch.long, device=dev)
        self.p_off = self.p_pos % self.block_size
        self.p_last = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.prefill_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.key: int | None = None

    def _reset_inputs(self) -> None:
        self.ids.zero_()
        self.pos.zero_()
        self.tables.fill_(self.scratch)
        self.ctx.fill_(1)

    def capture(self) -> None:
        """Capture every size for the weights the model points at now (idempotent)."""
        key = id(self.model.w)
        self.key = key
        if any(k == key for k, _ in self.graphs):
            return
        self._reset_inputs()
        self.p_ids.zero_()
        self.p_blk.fill_(self.scratch)
        self.p_last.zero_()
        torch.cuda.synchronize()
        for n in reversed(self.prefill_sizes):  # largest first, so smaller ones reuse its pool
            args = (self.p_ids[:n], self.p_pos[:n], self.p_blk[:n], self.p_off[:n], self.p_last, self.kv)
            with ops.no_cudnn_attention():
                self.prefill_graphs[(key, n)] = self._capture(self.model.prefill_static, args)
        for bs in reversed(self.sizes):
            args = (self.ids[:bs], self.pos[:bs], self.tables[:bs], self.ctx[:bs], self.kv)
            self.graphs[(key, bs)] = self._capture(self.model.decode_static, args)
        torch.cuda.synchronize()

    def _capture(self, fn, args) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*args)  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(*args)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def fits(self, batch: int, max_ctx: int) -> bool:
        return batch <= self.sizes[-1] and max_ctx <= self.max_blocks * self.block_size

    def run(self, ids: list[int], pos: list[int], tables: list[list[int]],
            ctx: list[int]) -> torch.Tensor:
        """Logits (len(ids), vocab) of one decode row per sequence."""
        n = len(ids)
        bs = next(s for s in self.sizes if s >= n)
        self._reset_inputs()
        self.ids[:n] = torch.tensor(ids)
        self.pos[:n] = torch.tensor(pos)
        self.ctx[:n] = torch.tensor(ctx)
        rows = torch.full((n, self.max_blocks), self.scratch, dtype=torch.long)
        for i, t in enumerate(tables):
            used = t[: -(-ctx[i] // self.block_size)]
            rows[i, : len(used)] = torch.tensor(used)
        self.tables[:n] = rows
        graph, out = self.graphs[(self.key, bs)]
        graph.replay()
        return out[:n]

    def fits_prefill(self, prompt_len: int) -> bool:
        return bool(self.prefill_sizes) and prompt_len <= self.prefill_sizes[-1]

    def run_prefill(self, ids: list[int], table: list[int]) -> torch.Tensor:
        """Logits (1, vocab) of the last row of a whole prompt ``ids`` (KV into ``table``).

        The result is a copy: the next prefill of the same padded length overwrites the
        graph's output.
        """
        n = len(ids)
        size = next(s for s in self.prefill_sizes if s >= n)
        bs = self.block_size
        host = torch.zeros(2, size, dtype=torch.long)
        host[0, :n] = torch.tensor(ids)
        host[1] = self.scratch  # padding rows write to the scratch block
        host[1, :n] = torch.as_tensor(table, dtype=torch.long)[torch.arange(n) // bs]
        dev = host.to(self.p_ids.device)
        self.p_ids[:size] = dev[0]
        self.p_blk[:size] = dev[1]
        self.p_last.fill_(n - 1)
        graph, out = self.prefill_graphs[(self.key, size)]
        graph.replay()
        return out.clone()
