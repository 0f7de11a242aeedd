"""Which KV slots each SGLang server may take (``kv_hooks/belayer_kv_slots.py``): no two live
processes ever write one slot, and every server's count stays SGLang's pool size (SGLang
raises on an idle server whose free + cached tokens differ from it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HOOKS = Path(__file__).resolve().parents[4] / "belayer_engine" / "backends" / "sglang" / "kv_hooks"
sys.path.insert(0, str(HOOKS))
import belayer_kv_slots as slots  # noqa: E402

ROWS, RESERVE = 1 + 64 + 8, 8  # slot 0, SGLang's pool of 64 tokens, 8 reserved beside it
SIZE = ROWS - 1 - RESERVE  # what SGLang's allocator counts (its --max-total-tokens)


def _set(t: torch.Tensor) -> set[int]:
    return set(t.tolist())


def _reserve() -> torch.Tensor:
    return torch.arange(ROWS - RESERVE, ROWS)


def test_a_worker_and_its_shadow_never_share_a_free_slot():
    reserve = _reserve()
    worker = slots.worker_plan(ROWS, reserve, "cpu", gate=None)
    shadow = slots.shadow_plan(ROWS, SIZE, reserve, "cpu")
    assert not _set(worker.free) & _set(shadow.free)
    assert _set(shadow.free) == _set(reserve)
    assert 0 not in _set(worker.free) | _set(shadow.free) | _set(shadow.hidden)  # slot 0 takes padded writes
    assert len(worker.free) + len(worker.hidden) == SIZE
    assert len(shadow.free) + len(shadow.hidden) == SIZE  # the hidden ones are only counted: no gate opens
    assert shadow.gate is None


def test_a_promoted_shadow_takes_only_the_old_reserve_until_the_dead_worker_is_reaped():
    reserve = _reserve()
    adopted = torch.tensor([3, 4, 5, 20, 21])
    new = slots.choose_reserve(ROWS, RESERVE, reserve, adopted)
    assert len(new) == RESERVE and not _set(new) & (_set(reserve) | _set(adopted))
    reaped = []
    plan = slots.promoted_plan(ROWS, reserve, adopted, new, "cpu", gate=lambda: bool(reaped))
    assert _set(plan.free) == _set(reserve)  # the dead worker never allocated there
    assert not _set(plan.hidden) & (_set(adopted) | _set(new) | _set(reserve))
    # free + hidden + adopted + the new reserve: every slot once; SGLang counts all but the reserve
    assert len(plan.free) + len(plan.hidden) + len(adopted) + len(new) == ROWS - 1
    assert len(plan.free) + len(plan.hidden) + len(adopted) == SIZE
    assert plan.gate is not None and not plan.gate()
    reaped.append(True)
    assert plan.gate()


def test_a_promoted_shadow_whose_predecessor_is_already_reaped_takes_everything_at_once():
    reserve = _reserve()
    adopted = torch.tensor([1, 2])
    new = slots.choose_reserve(ROWS, RESERVE, reserve, adopted)
    plan = slots.promoted_plan(ROWS, reserve, adopted, new, "cpu", gate=lambda: True)
    assert plan.gate is None and not len(plan.hidden)
    assert _set(plan.free) == set(range(1, ROWS)) - _set(adopted) - _set(new)


def test_a_cold_worker_after_a_dead_one_takes_nothing_before_the_reap():
    reserve = _reserve()
    plan = slots.worker_plan(ROWS, reserve, "cpu", gate=lambda: False)
    assert not len(plan.free) and len(plan.hidden) == SIZE
    assert not slots.wait_for(plan.gate, timeout_s=0.01)


def test_a_reserve_that_cannot_be_found_is_an_error():
    with pytest.raises(RuntimeError, match="untouched slots"):
        slots.choose_reserve(ROWS, RESERVE, _reserve(), torch.arange(1, ROWS))


def test_a_second_promotion_adopts_slots_numbered_past_the_old_reserve():
    """The worker promoted first allocated from the first reserve (the highest slots) before
    its own reserve was chosen lower down: its successor adopts slots above that reserve."""
    first = _reserve()
    adopted_first = torch.tensor([2, 3])
    second = slots.choose_reserve(ROWS, RESERVE, first, adopted_first)
    assert int(second.max()) < int(first.min())
    adopted_second = torch.tensor([int(first.min()), int(first.max()), 4])  # written from the first reserve
    third = slots.choose_reserve(ROWS, RESERVE, second, adopted_second)
    plan = slots.promoted_plan(ROWS, second, adopted_second, third, "cpu", gate=lambda: False)
    assert not _set(plan.free) & _set(adopted_second) and not _set(plan.hidden) & _set(adopted_second)
    assert len(plan.free) + len(plan.hidden) + len(adopted_second) == SIZE


def test_a_row_with_any_slot_outside_the_pool_or_in_the_old_reserve_is_never_trusted():
    """The adoption's check of the dead server's rows (``belayer_kv_adopt.bad_rows``), one
    host copy for every row: slot 0 (SGLang's padding), past the pool, or in the reserve the
    dead server never owned marks the whole row; empty rows are clean."""
    import belayer_kv_adopt as adopt
    import numpy as np

    in_reserve = np.zeros(ROWS, dtype=bool)
    in_reserve[_reserve().numpy()] = True
    reserved = int(_reserve()[0])
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4, 0, 5]), torch.tensor([], dtype=torch.int64),
            torch.tensor([6, ROWS]), torch.tensor([7, reserved]), torch.tensor([-3]), torch.tensor([ROWS - 9, 8])]
    flat = torch.cat(rows).numpy()
    assert adopt.bad_rows(flat, [len(r) for r in rows], in_reserve, ROWS) == \
        [False, True, False, True, True, True, False]
    assert adopt.bad_rows(flat[:0], [], in_reserve, ROWS) == []


def test_the_distinct_slots_of_several_parts_come_back_sorted():
    parts = [torch.tensor([9, 3, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([5, 9, 1])]
    assert slots.unique(ROWS, *parts).tolist() == [1, 3, 5, 9]
    assert slots.unique(ROWS).tolist() == []


def test_the_dead_servers_rows_are_copied_end_to_end_and_never_alias_its_table():
    """``belayer_kv_adopt.read_rows``: one gather on the device (what the radix tree keeps),
    one host copy (what the checks and the slot plans read), both owned by the successor:
    the dead server's table is reused by the next server that attaches."""
    import belayer_kv_adopt as adopt

    table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    on_device, flat = adopt.read_rows(table, [(1, 3), (3, 2), (0, 0)])
    assert flat.tolist() == [10, 11, 12, 30, 31] and on_device.dtype == torch.int64
    assert on_device.tolist() == flat.tolist()
    table.zero_()
    assert on_device.tolist() == flat.tolist() == [10, 11, 12, 30, 31]
    empty, nothing = adopt.read_rows(table, [])
    assert not empty.numel() and not nothing.size


def test_a_plans_free_and_hidden_slots_are_on_the_servers_device_as_int64():
    plan = slots.promoted_plan(ROWS, _reserve(), torch.tensor([3]), torch.arange(10, 18), "cpu", gate=lambda: False)
    assert plan.free.dtype == plan.hidden.dtype == torch.int64
    assert plan.free.device.type == plan.hidden.device.type == "cpu"


def test_a_reserve_naming_slots_outside_the_pool_is_never_planned_with():
    """The dead server's journal is read by its successor: a reserve with slot 0, a negative
    slot (numpy would wrap it onto a real one) or one past the pool makes the adoption fail,
    and the router re-prefills."""
    assert slots.in_pool(ROWS, _reserve(), "reserve").tolist() == _reserve().tolist()
    for bad in ([0, 5], [-3, 5], [5, ROWS]):
        with pytest.raises(RuntimeError, match="outside 1.."):
            slots.in_pool(ROWS, torch.tensor(bad), "the dead server's reserve")
