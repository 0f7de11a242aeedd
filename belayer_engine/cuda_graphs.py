"""CUDA graphs for decode steps (CUDA only; CPU uses the exact eager path).

Graphs are captured for a few batch sizes against the arena's KV tensor, with every
block-table slot pointing at a scratch block, so capturing (e.g. in a shadow) never
writes a live block; the live blocks share the tensor, so the graphs stay valid after
activation. Weights' addresses are baked in too, so each weight slot gets its own set
(captured when that slot is first served).
"""

from __future__ import annotations

import torch

from belayer_engine.model import Qwen3Model

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64)


class GraphRunner:
    """Replays the captured decode graph of the smallest batch size that fits."""

    def __init__(self, model: Qwen3Model, kv: torch.Tensor, max_blocks: int, scratch_block: int,
                 sizes: tuple[int, ...] = DEFAULT_SIZES):
        self.model, self.kv = model, kv
        self.sizes = tuple(sorted(sizes))
        self.max_blocks, self.scratch = max_blocks, scratch_block
        self.block_size = kv.shape[3]
        dev, bmax = model.device, self.sizes[-1]
        self.ids = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.pos = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.tables = torch.full((bmax, max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.ctx = torch.ones(bmax, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
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
        torch.cuda.synchronize()
        for bs in reversed(self.sizes):  # largest first, so smaller ones reuse its pool
            args = (self.ids[:bs], self.pos[:bs], self.tables[:bs], self.ctx[:bs], self.kv)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.model.decode_static(*args)  # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model.decode_static(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(key, bs)] = (graph, out)
        torch.cuda.synchronize()

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
