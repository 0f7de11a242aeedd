"""Which KV slots an SGLang server may allocate, so that no two live processes write one slot.

The pool has ``rows`` slots (0 absorbs padded writes; 1..rows-1 hold tokens). SGLang's
allocator is sized ``size = rows - 1 - reserve``: every server's free list plus what it holds
always counts ``size`` (SGLang checks that count when idle). Which slots they are:

- a serving worker: every slot but its *reserve* (``reserve`` slots its successor may use);
- its shadow: the worker's reserve (where its warm-up runs), plus slots it counts but never
  takes (``hidden``), so its count is ``size`` too;
- a promoted shadow: the old reserve (minus anything adopted) at once; every other slot
  but what it adopted and its own new reserve is ``hidden`` until the dead worker is reaped
  (``gate``): a kernel the dead worker had queued may still write one of them until then.
  An allocation that needs more than the free slots waits for the gate.
- a worker started cold after a dead one: nothing free until that one is reaped.

Standard library and torch only (runs in SGLang's interpreter).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class SlotPlan:
    """A server's allocator state: ``free`` now, ``hidden`` (counted, taken once ``gate()``)."""

    free: torch.Tensor
    hidden: torch.Tensor
    gate: Callable[[], bool] | None  # None: never opens (a shadow before promotion)


def _without(all_slots: torch.Tensor, *excluded: torch.Tensor, rows: int) -> torch.Tensor:
    """``all_slots`` minus every slot in ``excluded`` (which may name slots outside it); every
    slot named is below ``rows`` (no device sync to find the largest: right after a kill an
    H100 answered device work slowly)."""
    keep = torch.ones(rows, dtype=torch.bool, device=all_slots.device)
    for e in excluded:
        if e.numel():
            keep[e.to(all_slots.device)] = False
    return all_slots[keep[all_slots]]


def all_slots(rows: int, device) -> torch.Tensor:
    return torch.arange(1, rows, dtype=torch.int64, device=device)


def worker_plan(rows: int, own_reserve: torch.Tensor, device, gate: Callable[[], bool] | None) -> SlotPlan:
    """A serving worker: all but its reserve, at once or (a cold start after a dead worker)
    once ``gate()``."""
    every = _without(all_slots(rows, device), own_reserve, rows=rows)
    if gate is None or gate():
        return SlotPlan(free=every, hidden=every[:0], gate=None)
    return SlotPlan(free=every[:0], hidden=every, gate=gate)


def shadow_plan(rows: int, size: int, worker_reserve: torch.Tensor, device) -> SlotPlan:
    """A shadow: the worker's reserve, and ``size - len(reserve)`` slots it only counts."""
    reserve = torch.sort(worker_reserve.to(device)).values
    others = _without(all_slots(rows, device), reserve, rows=rows)
    return SlotPlan(free=reserve, hidden=others[: max(0, size - reserve.numel())], gate=None)


def promoted_plan(rows: int, old_reserve: torch.Tensor, adopted: torch.Tensor, new_reserve: torch.Tensor,
                  device, gate: Callable[[], bool]) -> SlotPlan:
    old = torch.sort(old_reserve.to(device)).values
    free = _without(old, adopted, rows=rows)
    hidden = _without(all_slots(rows, device), old, adopted, new_reserve, rows=rows)
    if gate():
        return SlotPlan(free=torch.cat((free, hidden)), hidden=hidden[:0], gate=None)
    return SlotPlan(free=free, hidden=hidden, gate=gate)


def choose_reserve(rows: int, reserve: int, old_reserve: torch.Tensor, adopted: torch.Tensor, device) -> torch.Tensor:
    """The promoted server's own reserve: ``reserve`` slots it never touched (the highest
    numbered outside the old reserve and what it adopted)."""
    untouched = _without(all_slots(rows, device), old_reserve, adopted, rows=rows)
    if untouched.numel() < reserve:
        raise RuntimeError(f"KV pool: only {untouched.numel()} untouched slots for a reserve of {reserve}")
    return untouched[-reserve:] if reserve else untouched[:0]


def wait_for(gate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``gate`` until it opens or ``timeout_s`` passes (the dead worker's reap: well
    under the supervisor's fence timeout)."""
    deadline = time.monotonic() + timeout_s
    while not gate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
