"""Which prefill batches after an adoption run as the dead server's next decode step
(``kv_hooks/belayer_kv_continue.py``). SGLang runs them end to end in ``test_sglang_native.py``;
here the rule itself, on the fields of SGLang's batch it reads, case by case."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

HOOKS = Path(__file__).resolve().parents[4] / "belayer_engine" / "backends" / "sglang" / "kv_hooks"
sys.path.insert(0, str(HOOKS))
import belayer_kv_continue as kc  # noqa: E402
from belayer_kv_state import S  # noqa: E402

PROMPT, COMMITTED = 100, 130
ROW = np.arange(1000, 1000 + COMMITTED)  # the adopted row: 100 prompt ids, 30 generated


@pytest.fixture(autouse=True)
def adopted_row():
    kc.remember([(PROMPT, COMMITTED, ROW)])
    yield
    S.continuations, S.arrivals = [], []


def _batch(*requests, return_logprob=False, logprob_starts=None, spec=None):
    """SGLang's extend batch as the hook reads it: per request its ids and cached prefix."""
    reqs = [SimpleNamespace(origin_input_ids=list(ids), multimodal_inputs=None) for ids, _ in requests]
    return SimpleNamespace(reqs=reqs, prefix_lens=[p for _, p in requests],
                           extend_lens=[len(ids) - p for ids, p in requests], return_logprob=return_logprob,
                           extend_logprob_start_lens=logprob_starts, spec_algorithm=spec)


def _resent(generated: int) -> list[int]:
    """What the router re-sends after ``generated`` ids: prompt + generated, the newest uncached."""
    return ROW[: PROMPT + generated].tolist()


def test_the_resent_continuation_runs_as_a_decode_step_once():
    batch = _batch((_resent(30), PROMPT + 29))
    assert kc._not_a_continuation(batch) is None
    assert S.continuations == []  # consumed: a second prefill of the same ids is an ordinary one
    assert kc._not_a_continuation(batch) is not None


def test_a_client_behind_the_journal_continues_from_an_earlier_generated_position():
    """The router may hold fewer ids than the row journaled (the stream lagged the kill)."""
    assert kc._not_a_continuation(_batch((_resent(12), PROMPT + 11))) is None


@pytest.mark.parametrize("ids, cached, why", [
    (_resent(30), PROMPT + 28, "new ids per request"),  # two new ids: a real extend
    (ROW[:PROMPT].tolist(), PROMPT - 1, "not at a generated position"),  # the prompt's last id: a prefill's logits
    (_resent(30)[:-2] + [7, 7], PROMPT + 29, "not at a generated position"),  # other ids than the row's
    ([5] + _resent(30)[1:], PROMPT + 29, None),  # differs only before the compared tail: SGLang's tree matched it
])
def test_only_one_new_id_at_a_generated_position_of_the_row_qualifies(ids, cached, why):
    found = kc._not_a_continuation(_batch((ids, cached)))
    assert (found is None) if why is None else (why in found), found


def test_a_batch_qualifies_only_whole():
    """One ordinary request in the batch and the model must run it as the extend it is."""
    found = kc._not_a_continuation(_batch((_resent(30), PROMPT + 29), ([1, 2, 3], 0)))
    assert "new ids per request" in found
    assert len(S.continuations) == 1  # nothing consumed


def test_input_logprobs_and_speculation_keep_the_extend():
    one = (_resent(30), PROMPT + 29)
    assert "logprobs" in kc._not_a_continuation(_batch(one, return_logprob=True, logprob_starts=[0]))
    assert kc._not_a_continuation(_batch(one, return_logprob=True, logprob_starts=[1])) is None  # output logprobs only
    kc.remember([(PROMPT, COMMITTED, ROW)])
    eagle = SimpleNamespace(is_none=lambda: False)
    assert kc._not_a_continuation(_batch(one, spec=eagle)) == "speculative decoding"


def test_arrivals_are_timed_from_the_adoption():
    assert S.arrivals == [] and S.adoption_end <= time.perf_counter()
    assert kc._ms_list([3.24, 41.6]) == "[3, 42]"


@pytest.fixture
def gathering():
    S.gather_until = time.perf_counter() + 3600  # the first continuation just arrived
    yield
    S.gather_until = None


def test_the_first_batch_waits_for_every_adopted_request(gathering):
    assert kc.holding(waiting=0)  # one adopted request awaited, none back yet
    assert not kc.holding(waiting=1)  # all back: the batch runs
    assert S.gather_until is None and not kc.holding(waiting=0)  # gathered once per adoption


def test_gathering_ends_at_its_deadline(gathering):
    S.gather_until = time.perf_counter() - 1e-3
    assert not kc.holding(waiting=0)
    assert S.gather_until is None


def test_nothing_is_held_without_awaited_continuations(gathering):
    S.continuations = []
    assert not kc.holding(waiting=0)


class _Scheduler:
    """The three methods of SGLang's Scheduler the hook wraps, recording what ran when."""

    def __init__(self):
        self.waiting_queue, self.ran = [], []

    def process_input_requests(self, recv_reqs):
        self.ran.append(("inputs", len(recv_reqs)))

    def handle_generate_request(self, recv_req):
        self.waiting_queue.append(recv_req)

    def _get_new_batch_prefill_raw(self, prefill_delayer_single_pass, running_batch):
        self.ran.append(("prefill", len(self.waiting_queue)))
        return "batch", running_batch


def test_an_answered_adoption_runs_after_the_passs_inputs_and_before_any_batch(gathering):
    cls = type("Scheduler", (_Scheduler,), {})
    kc.patch_scheduler(SimpleNamespace(Scheduler=cls))
    sched = cls()
    S.pending_adoption = lambda: sched.ran.append(("adopted", None))
    sched.process_input_requests(["resume"])
    assert sched.ran == [("inputs", 1), ("adopted", None)] and S.pending_adoption is None
    assert sched._get_new_batch_prefill_raw(prefill_delayer_single_pass=None, running_batch="running") == (None, "running")
    sched.handle_generate_request(SimpleNamespace(rid="r-1"))  # the adopted request is back
    assert sched._get_new_batch_prefill_raw(prefill_delayer_single_pass=None, running_batch="running") == ("batch", "running")
