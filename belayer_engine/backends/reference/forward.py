"""One scheduler step's logits: CUDA graphs when every shape fits, else one eager call.

``batch`` is the running requests followed by the new ones (``new``): a running request
contributes one decode row (its last token), a new one its whole prompt. The rows' KV is
written into the request's reserved blocks, so re-running a step rewrites the same
positions (the scheduler re-runs a failed batch one request at a time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from belayer_engine.backends.reference.model import Qwen3Model, SeqBatch
from belayer_engine.backends.reference.request import Request

if TYPE_CHECKING:
    from belayer_engine.backends.reference.graphs import GraphRunner


def graph_logits(graphs: GraphRunner | None, batch: list[Request], new: list[Request]) -> torch.Tensor | None:
    """Logits of one step from CUDA graphs: the decode graph for the running requests and
    one prefill graph per new request; None when some shape is not covered, and the eager
    path runs the whole step instead."""
    if graphs is None or not all(graphs.fits_prefill(len(r.prompt)) for r in new):
        return None
    parts = []
    if len(batch) > len(new):
        decoded = _graph_decode(graphs, batch[: len(batch) - len(new)])
        if decoded is None:
            return None
        parts.append(decoded.clone())  # graphs share a memory pool: copy before the next replay
    parts += [graphs.run_prefill(r.prompt, r.blocks) for r in new]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _graph_decode(graphs: GraphRunner, batch: list[Request]) -> torch.Tensor | None:
    ctx = [len(r.prompt) + len(r.output) for r in batch]
    if not graphs.fits(len(batch), max(ctx)):
        return None
    return graphs.run([r.output[-1] for r in batch], [c - 1 for c in ctx], [r.blocks for r in batch], ctx)


def eager_logits(model: Qwen3Model, kv: torch.Tensor | None, batch: list[Request],
                 new: list[Request]) -> torch.Tensor:
    """Logits of one step from one forward call over every request's rows."""
    ids, pos, seqs = [], [], []
    for r in batch:
        ctx = len(r.prompt) + len(r.output)
        rows = r.prompt if r in new else [r.output[-1]]
        first = ctx - len(rows)
        seqs.append(SeqBatch(len(ids), len(ids) + len(rows), ctx, r.blocks))
        ids.extend(rows)
        pos.extend(range(first, ctx))
    return model.forward(torch.tensor(ids), torch.tensor(pos), seqs, kv)
