"""slime's custom generate function (wrappers/slime/rollout.py) against Belayer's engine and
real sandboxes, called the way slime calls it.

slime is not on the package index and is NOT run here. What stands in for it follows its
source (THUDM/slime at 624b824, quoted per line below):

- ``SlimeSample`` has exactly the ``Sample`` fields (slime/utils/types.py) that slime's
  rollout code reads or writes around a custom generate function;
- ``slime_args`` carries the ``args`` slime's rollout reads (slime/utils/arguments.py);
- ``sampling_params`` is the dict ``GenerateState`` builds (slime/rollout/sglang_rollout.py
  lines 95-105) from those args, ``spaces_between_special_tokens=False`` included;
- ``slime_generate_and_rm`` is the dispatch of ``generate_and_rm`` (sglang_rollout.py lines
  252-262, 282-286) and ``train_fields`` the reads of ``_convert_samples_to_train_data``
  (slime/ray/rollout.py lines 658-681, 716).

The engine is the embedded model on the reference CPU worker with a shadow; the run is
greedy through top-k 1 (slime rejects temperature 0: arguments.py lines 1770-1773), so a
run with faults must give the fault-free run's sample token for token.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import signal
import threading
from argparse import Namespace
from dataclasses import dataclass, field
from enum import Enum
from urllib.parse import urlsplit

import pytest

from belayer_engine import RecoverableEngine
from tests.belayer.wrappers.episodes import EPISODE, UNRECOVERABLE, first_sandbox_only
from tests.belayer.wrappers.episodes import model_spans as spans_of
from tests.belayer_engine.conftest import poll

pytestmark = pytest.mark.timeout(600)

PROMPT = "<|im_start|>user\nList the files in /tmp, then submit.<|im_end|>\n<|im_start|>assistant\n"
TOL = 1e-4  # logprobs of a re-prefilled continuation (bit-equal on this CPU so far)


@dataclass
class SlimeSample:
    """slime/utils/types.py ``Sample``: the fields read or written around a custom generate."""

    class Status(Enum):  # types.py lines 130-138
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None  # line 97
    index: int | None = None  # line 98
    prompt: str | list[dict[str, str]] = ""  # line 108
    tokens: list[int] = field(default_factory=list)  # line 109
    response: str = ""  # line 115
    response_length: int = 0  # line 116
    label: str | None = None  # line 117
    reward: float | dict | None = None  # line 118
    loss_mask: list[int] | None = None  # line 119
    weight_versions: list[str] = field(default_factory=list)  # line 120
    rollout_log_probs: list[float] | None = None  # line 121
    remove_sample: bool = False  # line 127
    status: Status = Status.PENDING  # line 140
    metadata: dict = field(default_factory=dict)  # line 142
    generate_function_path: str | None = None  # line 143
    session_id: str | None = None  # set by generate_and_rm_group (sglang_rollout.py line 313)


def slime_args(engine) -> Namespace:
    u = urlsplit(engine.base_url)
    return Namespace(
        sglang_router_ip=u.hostname, sglang_router_port=u.port,  # sglang_rollout.py line 158
        hf_checkpoint=None,  # the embedded model (GenerateState line 91 loads its tokenizer)
        custom_generate_function_path="belayer.wrappers.slime.generate",  # arguments.py line 477
        partial_rollout=False, group_rm=False,
        rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=1,  # top-k 1: greedy
        rollout_max_response_len=600, rollout_stop=None, rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        belayer_episode=EPISODE)


def sampling_params(args: Namespace) -> dict:
    """GenerateState.sampling_params (sglang_rollout.py lines 95-105); ``custom_params`` only
    when top_p != 1.0 (lines 106-107)."""
    return dict(temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
                max_new_tokens=args.rollout_max_response_len, stop=args.rollout_stop,
                stop_token_ids=args.rollout_stop_token_ids, skip_special_tokens=args.rollout_skip_special_tokens,
                no_stop_trim=True, spaces_between_special_tokens=False)


async def slime_generate_and_rm(args: Namespace, sample: SlimeSample, params: dict) -> SlimeSample:
    """generate_and_rm's dispatch (sglang_rollout.py lines 252-262) and its checks after it
    (lines 282-286): an aborted sample is returned as is; a reward left None would go to
    slime's reward model, which this generate function never leaves to it."""
    path = getattr(sample, "generate_function_path", None) or args.custom_generate_function_path
    module, _, attr = path.rpartition(".")  # slime/utils/misc.py load_function, lines 45-47
    func = getattr(importlib.import_module(module), attr)
    if "evaluation" in inspect.signature(func).parameters:
        sample = await func(args, sample, params, evaluation=False)
    else:
        sample = await func(args, sample, params)
    if sample.status != SlimeSample.Status.ABORTED:
        assert sample.reward is not None, "the env's reward must be filled (else slime's rm runs)"
    return sample


def train_fields(sample: SlimeSample) -> dict:
    """What _convert_samples_to_train_data reads (slime/ray/rollout.py lines 658-681, 716)."""
    assert len(sample.loss_mask) == sample.response_length  # lines 677-679
    assert len(sample.rollout_log_probs) == sample.response_length
    return {"tokens": sample.tokens, "response_length": sample.response_length, "reward": sample.reward,
            "truncated": sample.status == SlimeSample.Status.TRUNCATED, "loss_mask": sample.loss_mask,
            "rollout_log_probs": sample.rollout_log_probs}


def run(args: Namespace, **episode) -> SlimeSample:
    args = Namespace(**{**vars(args), "belayer_episode": {**EPISODE, **episode}})
    sample = SlimeSample(index=0, group_index=0, prompt=PROMPT)
    return asyncio.run(slime_generate_and_rm(args, sample, sampling_params(args)))


@pytest.fixture(scope="module")
def engine():
    with RecoverableEngine.launch(workers=1, shadow=True) as eng:
        eng.wait_ready(timeout=180)
        yield eng


@pytest.fixture(scope="module")
def golden(engine):
    """The fault-free episode: 3 turns of 24 model tokens, each followed by its observation."""
    return run(slime_args(engine))


def model_spans(sample: SlimeSample) -> list[tuple[int, int]]:
    """(start, end) of every run of loss-mask 1 in the response."""
    return spans_of(sample.loss_mask)


def assert_same_sample(sample: SlimeSample, golden: SlimeSample) -> None:
    got, want = train_fields(sample), train_fields(golden)
    assert got["tokens"] == want["tokens"] and got["loss_mask"] == want["loss_mask"]
    assert (got["response_length"], got["reward"], got["truncated"]) == \
        (want["response_length"], want["reward"], want["truncated"])
    assert max(abs(a - b) for a, b in zip(got["rollout_log_probs"], want["rollout_log_probs"], strict=True)) <= TOL
    assert sample.response == golden.response


def test_a_fault_free_episode_fills_the_sample_as_slime_reads_it(golden):
    s = golden
    assert s.status == SlimeSample.Status.TRUNCATED and s.reward == 0.0  # max_turns, no submit
    assert not s.remove_sample
    prompt_len = len(s.tokens) - s.response_length
    assert prompt_len > 0 and s.response_length <= 600
    # three model turns of 24 trainable tokens (with their logprobs), observations between them
    spans = model_spans(s)
    assert [e - b for b, e in spans] == [24, 24, 24]
    assert spans[0][0] == 0 and spans[-1][1] == s.response_length  # ends with the last action
    for b, e in spans:
        assert all(lp < 0 or lp == 0.0 for lp in s.rollout_log_probs[b:e])
    for (_, e), (b, _) in zip(spans, spans[1:], strict=False):  # observation tokens: mask 0, logprob 0.0
        assert e < b and set(s.rollout_log_probs[e:b]) == {0.0}
    assert s.response.count("<returncode>") == 2  # observations of turns 1 and 2 (turn 3 ends it)
    assert s.weight_versions == [s.weight_versions[0]] * 3  # one per model call, one version
    assert s.metadata["belayer"] == {"rollbacks": [], "worker_recoveries": 0, "turns": 3, "recovered": False,
                                     "fresh_sandbox_retries": 0, "retried_after": []}


def test_a_killed_container_rolls_back_and_the_sample_is_cut_to_the_same_boundary(engine, golden):
    """A real SIGKILL of the sandbox's container at the start of turn 2's command
    (``FaultInjection``: the project's own injector, through ``EpisodeConfig.faults``): the
    env restores a boundary j <= 1, the sample's tokens are cut back to j, the model
    regenerates from there, and the sample equals the fault-free one token for token."""
    s = run(slime_args(engine), faults={"at_steps": {2: "kill"}, "max_delay_s": 0.0})
    rollbacks = s.metadata["belayer"]["rollbacks"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] <= 1 and rollbacks[0]["tokens_cut"] >= 24, rollbacks
    assert s.metadata["belayer"]["recovered"] is True and s.metadata["belayer"]["turns"] == 3
    assert s.status == SlimeSample.Status.TRUNCATED and not s.remove_sample
    assert_same_sample(s, golden)
    assert len(s.weight_versions) == 3  # the cut turn's call is gone with its tokens


def test_the_serving_worker_sigkilled_mid_turn_is_continued_by_the_engine(engine, golden):
    """A real SIGKILL of the serving worker's process group while turn 2 generates: the
    engine continues it on the shadow, slime's request gets one generation, and the sample
    equals the fault-free one (ids, logprobs, one weight version)."""
    native = engine.router.native
    seen: list[str] = []
    killed: dict = {}

    def kill_during_turn_2() -> None:
        def second_generating() -> bool:
            seen.extend(rid for rid in list(native.running) if rid not in seen)
            second = native.running.get(seen[1]) if len(seen) > 1 else None
            return second is not None and len(second.gen.generated) >= 4
        try:
            poll(second_generating, 120, "turn 2 to have generated 4 tokens", interval=0.002)
            killed["pid"] = engine.worker_pid(0)
            os.killpg(killed["pid"], signal.SIGKILL)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            killed["error"] = e

    t = threading.Thread(target=kill_during_turn_2, daemon=True)
    t.start()
    s = run(slime_args(engine))
    t.join(30)
    assert not t.is_alive() and "error" not in killed and killed.get("pid"), killed
    assert s.metadata["belayer"]["worker_recoveries"] >= 1
    assert s.metadata["belayer"]["rollbacks"] == []
    assert_same_sample(s, golden)
    assert s.weight_versions == golden.weight_versions
    poll(lambda: engine.worker_pid(0) not in (None, killed["pid"]), 120, "the shadow to serve slot 0")


def test_a_sample_beyond_recovery_is_retried_in_a_fresh_sandbox(engine, golden):
    """No checkpoints, one recovery attempt allowed, and that restore (boundary 0's fresh
    sandbox) armed to fail, then a real SIGKILL of the container in turn 2 (in the first
    sandbox only: ``episodes: 1``): the env gives up, the infrastructure policy resets a fresh
    sandbox (a rollback to 0), the sample regenerates from its prompt and equals the fault-free
    one, labelled."""
    s = run(slime_args(engine), **first_sandbox_only(UNRECOVERABLE))
    label = s.metadata["belayer"]
    assert label["fresh_sandbox_retries"] == 1 and "dropped" not in label, label
    assert label["retried_after"][0]["error"] in ("RestoreFailed", "SandboxLost", "InjectedFault"), label
    assert label["rollbacks"][-1]["to_step"] == 0 and label["rollbacks"][-1]["fresh_sandbox"] == 1
    assert s.status == SlimeSample.Status.TRUNCATED and not s.remove_sample
    assert_same_sample(s, golden)


def test_past_its_retries_the_sample_is_dropped_with_its_group(engine, golden):
    """The same faults in every sandbox: after the policy's 2 fresh sandboxes the sample is
    ABORTED with ``remove_sample`` and no reward (never 0), labelled, holding only a consistent
    prefix; slime's dynamic filter (``keep_group``) drops its whole prompt group. A sandbox
    whose every command is killed spends its rollback budget (``infra.max_rollbacks``) the same way."""
    from belayer.wrappers.slime import keep_group

    s = run(slime_args(engine), **UNRECOVERABLE)
    label = s.metadata["belayer"]
    assert s.status == SlimeSample.Status.ABORTED and s.remove_sample and s.reward is None
    assert len(label["dropped"]) == 3 and label["fresh_sandbox_retries"] == 3, label
    assert set(label["dropped"]) <= {"RestoreFailed", "SandboxLost", "InjectedFault"}, label
    first = model_spans(golden)[1][0]  # boundary 1: turn 1 and its observation
    assert s.tokens == golden.tokens[: len(golden.tokens) - golden.response_length + first]
    assert s.loss_mask == golden.loss_mask[:first] and s.response_length == first
    assert "SandboxLost" not in s.response and "Restore" not in s.response
    assert keep_group(slime_args(engine), [golden, s]) is False  # slime: DynamicFilterOutput(keep=False, ...)
    assert keep_group(slime_args(engine), [golden, golden]) is True

    s = run(slime_args(engine), infra={"max_rollbacks": 2, "retries": 0},
            faults={"probability": 1.0, "kinds": ["kill"], "max_delay_s": 0.0})
    assert s.status == SlimeSample.Status.ABORTED and s.remove_sample and s.reward is None
    assert s.metadata["belayer"]["dropped"] == ["RollbackBudgetSpent"]
    assert len(s.metadata["belayer"]["rollbacks"]) == 2 and s.response_length == 0
    assert s.tokens == golden.tokens[: len(golden.tokens) - golden.response_length]


def test_the_calls_slime_makes_to_an_external_engine(engine):
    """Besides ``/generate``: discovery (slime/backends/sglang_utils/external.py lines 77-86,
    95-99: ``GET /server_info``, then ``/get_server_info``) and the end of every rollout
    (sglang_rollout.py line 349 -> server_control.py lines 32-40: ``POST /abort_request``
    ``{"abort_all": true}``, then ``GET /v1/loads?include=core`` until it counts 0 requests)."""
    from tests.belayer_engine.router.native_client import call

    base = engine.base_url.removesuffix("/v1")
    status, info = call(base, "GET", "/server_info")
    assert status == 200 and isinstance(info, dict), info
    pp = int(info.get("pp_size") or info.get("pipeline_parallel_size") or 1)  # external.py lines 95-97
    tp = int(info.get("tp_size") or info.get("tensor_parallel_size") or 1)
    assert int(info.get("num_gpus") or info.get("num_gpus_per_engine") or tp * pp) >= 1
    assert info.get("disaggregation_mode") not in ("prefill", "decode") and not info.get("encoder_only")
    assert call(base, "POST", "/abort_request", {"abort_all": True})[0] == 200
    status, load = call(base, "GET", "/v1/loads?include=core")
    assert status == 200, (status, load)
    # server_control.num_requests_from_load (lines 12-29): an idle engine counts 0
    load = load.get("loads", load) if isinstance(load, dict) else load
    loads = load if isinstance(load, list) else [load]
    assert sum(int(x.get("num_reqs", x.get("num_total_reqs", x.get("total_reqs", 0))) or 0)
               + int(x.get("num_running_reqs", x.get("total_running_reqs", 0)) or 0)
               + int(x.get("num_waiting_reqs", x.get("total_waiting_reqs", 0)) or 0) for x in loads) == 0
