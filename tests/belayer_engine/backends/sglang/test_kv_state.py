"""The KV hook reads a request's row where each SGLang version keeps it (0.5.17: on the
request, beside an unrelated ``kv`` record; 0.5.23: on ``req.kv``)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

HOOKS = Path(__file__).resolve().parents[4] / "belayer_engine" / "backends" / "sglang" / "kv_hooks"
sys.path.insert(0, str(HOOKS))
from belayer_kv_state import row_of  # noqa: E402


def test_the_row_of_a_request_in_either_sglang():
    v0517 = SimpleNamespace(req_pool_idx=7, kv=SimpleNamespace(kv_allocated_len=3, swa_evicted_seqlen=0))
    v0523 = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=9, kv_allocated_len=3))
    assert row_of(v0517) == 7 and row_of(v0523) == 9
    assert row_of(SimpleNamespace(req_pool_idx=None, kv=None)) is None  # freed
    assert row_of(SimpleNamespace(kv=SimpleNamespace(req_pool_idx=None))) is None
