"""The allocator of an SGLang server on the arena's pool: which slots it takes, and when
(``belayer_kv_slots`` plans them; the hidden ones join once the gate opens)."""

from __future__ import annotations

import time

import belayer_kv_journal as jr
import belayer_kv_slots as slots
from belayer_kv_state import S, say, source_reaped


def patch_allocator(module) -> None:
    cls = module.TokenToKVPoolAllocator
    alloc, available, clear_ = cls.alloc, cls.available_size, cls.clear

    def clear(self):
        """SGLang's own clear (its version's free-group fields), then this server's slots."""
        if S.journal is None:  # not a pool the arena serves (never expected here)
            raise RuntimeError("belayer kv: the allocator was built before the arena's pool")
        clear_(self)
        first = S.allocator is None
        S.allocator = self
        apply_plan(self, _plan_for_clear(self))
        self.release_pages = self.free_pages[:0].clone()
        if first:
            say(f"{S.role} allocator: {len(self.free_pages)} slots free, {len(self._belayer_hidden)} counted until "
                f"{'the gate opens' if self._belayer_gate else 'promotion' if S.role == 'shadow' else 'never'} "
                f"(SGLang's size {self.size})")

    def alloc_(self, need_size: int):
        if need_size > len(self.free_pages) + len(self.release_pages):
            open_gate(self, wait=True)
        return alloc(self, need_size)

    def available_size(self):
        return available(self) + int(getattr(self, "_belayer_hidden", self.free_pages[:0]).numel())

    cls.clear, cls.alloc, cls.available_size = clear, alloc_, available_size


def _plan_for_clear(allocator) -> slots.SlotPlan:
    device = allocator.device
    own = S.journal.reserve.copy()
    if S.promoted and S.adopted_reserve is not None and S.source_journal is not None \
            and not S.source_journal.header[jr.H_REAPED]:
        return slots.promoted_plan(S.rows, S.adopted_reserve, own[:0], own, device, source_reaped)
    if S.role == "worker" or S.promoted:
        gate = None if (S.promoted or S.source is None) else source_reaped
        return slots.worker_plan(S.rows, own, device, gate)
    deadline = time.monotonic() + S.gate_timeout_s * 10
    while not S.source_journal.header[jr.H_RESERVE_READY]:  # the worker's reserve is final once its predecessor is gone
        if time.monotonic() > deadline:
            raise RuntimeError(f"belayer kv: the serving worker's reserve never became ready ({S.source['sid']})")
        time.sleep(0.01)
    return slots.shadow_plan(S.rows, allocator.size, S.source_journal.reserve.copy(), device)


def apply_plan(allocator, plan: slots.SlotPlan) -> None:
    allocator.free_pages = plan.free
    allocator._belayer_hidden = plan.hidden
    allocator._belayer_gate = plan.gate


def open_gate(allocator, wait: bool) -> None:
    """Hidden slots join the free list once the gate opens (waiting for it when ``wait``)."""
    import torch

    hidden, gate = getattr(allocator, "_belayer_hidden", None), getattr(allocator, "_belayer_gate", None)
    if hidden is None or not hidden.numel() or gate is None:
        return
    if not gate():
        if not wait:
            return
        t0 = time.monotonic()
        if not slots.wait_for(gate, S.gate_timeout_s):
            raise RuntimeError(f"belayer kv: KV reserve used up and {S.source and S.source['sid']} not reaped "
                               f"after {S.gate_timeout_s:.0f}s")
        say(f"waited {time.monotonic() - t0:.3f}s for the dead server's reap before allocating past the reserve")
    allocator.free_pages = torch.cat((allocator.free_pages, hidden))
    allocator._belayer_hidden, allocator._belayer_gate = hidden[:0], None
