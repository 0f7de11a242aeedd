"""Token-level context recovery: one logical generation over as many workers as it takes.

The router records every token id it has streamed to the client. When the worker fails,
the same request is re-sent to a live worker as ``prompt + generated`` with the remaining
budget, and the continuation is spliced in: nothing is lost, nothing is sent twice. With
greedy decoding the worker's exact re-prefill makes the result token-identical to a
fault-free run (the reference worker; SGLang on CPU). In ``replay`` mode the prompt alone is
re-sent and the worker samples the generated ids again, forced, through its decode path
(``forced_decode.py``): with SGLang's deterministic mode on a GPU that is what keeps the
continuation the fault-free run's. In ``chunk`` mode the preserved prefix only advances every k tokens (the
reference paper's scheme); the regenerated tail is compared with what the client already
has and suppressed, and counted in ``regenerated``.

Logprobs (when asked for) travel with the ids: each worker scores the tokens it generates,
so after a failover the continued part's logprobs are the new worker's, and the lists stay
aligned with ``generated`` (a suppressed regenerated tail drops its logprobs too).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from belayer_core.errors import RequestFailed, WorkerLost
from belayer_engine.common.routing import RoutingTable

from .admission import Admission
from .config import RouterConfig
from .forced_decode import replay_fields
from .upstream import Chunk, WorkerBusy, stream_generate

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """The state of one logical request, kept by the router across workers."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: dict
    top_logprobs_num: int | None = None  # None: no logprobs asked for
    rid: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per generated id, when asked for
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    finish: dict | None = None
    recoveries: int = 0
    regenerated: int = 0
    reprefilled: int = 0  # generated ids re-sent as input to a replacement worker (prefilled, not decoded)
    replayed: int = 0  # generated ids a replacement worker decoded again, forced (recovery="replay")
    adopted: int = 0  # input ids a replacement found in its cache: KV it adopted from the dead worker
    workers: list[str] = field(default_factory=list)
    weight_version: object = None
    weight_versions: list = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    diverged: bool = False
    group: object = None  # the client request it belongs to (admission serves requests in turn)

    def summary(self) -> dict:
        return {
            "rid": self.rid,
            "recoveries": self.recoveries,
            "regenerated_tokens": self.regenerated,
            "reprefilled_tokens": self.reprefilled,
            "replayed_tokens": self.replayed,
            "adopted_tokens": self.adopted,
            "workers": self.workers,
            "failures": self.failures,
            "weight_version": self.weight_version,
            "weight_versions": self.weight_versions,  # more than one: the response mixes versions
            "diverged": self.diverged,
        }


def _time_of(record: dict, key: str):
    """A callback that stamps ``record[key]`` with the wall-clock time it is called at."""
    return lambda: record.__setitem__(key, time.time())


def _version(v):
    """SGLang reports weight versions as strings ("3"); the reference worker as ints."""
    return int(v) if isinstance(v, str) and v.isdigit() else v


class _Diverged(Exception):
    """A regenerated tail differs from what the client already has.

    Happens in chunk mode with sampling, or where re-prefill is not bit-exact (bf16 on GPU).
    """


class Continuation:
    """Drives a ``Generation`` to completion, yielding only new token ids (and worker text)."""

    def __init__(self, table: RoutingTable, session: aiohttp.ClientSession, config: RouterConfig):
        self.table = table
        self.session = session
        self.config = config
        self.admission = Admission(table, session, config.max_waiting_generations, config.connect_timeout_s)

    async def run(self, gen: Generation) -> AsyncIterator[Chunk]:
        cfg = self.config
        force_token_level = False
        attempt = busy = 0
        after_worker_failure = False  # this attempt replays the request after a WorkerLost
        while True:
            # replay: the prompt alone, the generated ids forced again (and skipped below)
            replay = cfg.recovery == "replay" and after_worker_failure and bool(gen.generated) \
                and not force_token_level
            if replay:
                keep = 0
            elif cfg.recovery == "chunk" and not force_token_level:
                keep = (len(gen.generated) // cfg.chunk_tokens) * cfg.chunk_tokens
            else:
                keep = len(gen.generated)
            skip = len(gen.generated) - keep
            body = {
                "input_ids": gen.prompt_ids + gen.generated[:keep],
                "sampling_params": {**gen.sampling, "max_new_tokens": gen.max_new_tokens - keep},
                "stream": True,
                "rid": f"{gen.rid}-{attempt}",
            }
            if replay:
                extra_body, extra_sampling = replay_fields(gen.generated)
                body.update(extra_body)
                body["sampling_params"].update(extra_sampling)
            if gen.top_logprobs_num is not None:  # SGLang's fields; the new worker scores what it generates
                body["return_logprob"] = True
                if gen.top_logprobs_num:
                    body["top_logprobs_num"] = gen.top_logprobs_num
            tokens = len(body["input_ids"]) + body["sampling_params"]["max_new_tokens"]
            endpoint = await self.admission.enter(tokens, gen.group if gen.group is not None else id(gen),
                                                  cfg.request_wait_s)
            try:
                attempt += 1
                gen.workers.append(f"{endpoint.slot}#{endpoint.instance}")
                replaying = after_worker_failure
                if replaying:
                    endpoint.replaying += 1
                    gen.failures[-1]["resent_t"] = time.time()  # where a recovery's wait goes, per request
                    gen.reprefilled += keep
                    gen.replayed += skip if replay else 0
                progressed = False
                upstream = stream_generate(
                    self.session, endpoint, body, stall_timeout=cfg.stall_timeout_s,
                    connect_timeout=cfg.connect_timeout_s, probe_timeout=cfg.stall_probe_timeout_s,
                    max_silence=cfg.max_silence_s,
                    on_headers=_time_of(gen.failures[-1], "headers_t") if replaying else None,
                )
                try:
                    # aclosing: when the client goes away (or a stop string ends the request) the
                    # worker stream is closed at once, which aborts the request on the worker.
                    async with contextlib.aclosing(upstream):
                        async for chunk in upstream:
                            if replaying and not progressed and (chunk.ids or chunk.finish):
                                progressed = True
                                endpoint.replaying -= 1
                                gen.failures[-1]["first_token_t"] = time.time()
                                cached = chunk.meta.get("cached_tokens")  # SGLang: this attempt's prefix-cache hit
                                if isinstance(cached, int) and not isinstance(cached, bool) and cached > 0:
                                    gen.adopted += cached
                            new, lps, top = chunk.ids, chunk.logprobs, chunk.top
                            if skip:
                                tail = gen.generated[len(gen.generated) - skip :]
                                overlap = new[: len(tail)]
                                if overlap != tail[: len(overlap)]:
                                    raise _Diverged()
                                if not replay:
                                    gen.regenerated += len(overlap)
                                skip -= len(overlap)
                                new = new[len(overlap) :]
                                # the client keeps the logprobs it already has for the overlap
                                lps = None if lps is None else lps[len(overlap) :]
                                top = None if top is None else top[len(overlap) :]
                                if chunk.finish and skip:
                                    raise _Diverged()
                            gen.generated.extend(new)
                            if lps is not None:
                                gen.logprobs.extend(lps)
                            if top is not None:
                                gen.top_logprobs.extend(top)
                            gen.weight_version = _version(chunk.meta.get("weight_version", gen.weight_version))
                            if gen.weight_version is not None and gen.weight_version not in gen.weight_versions:
                                gen.weight_versions.append(gen.weight_version)
                            if chunk.finish:
                                gen.finish = chunk.finish
                            if new or chunk.finish:
                                yield Chunk(ids=new, text=chunk.text, finish=chunk.finish, meta=chunk.meta,
                                            logprobs=lps, top=top)
                            if chunk.finish:
                                return
                except _Diverged:
                    log.warning("request %s: regenerated tail diverged; resuming token-level", gen.rid)
                    force_token_level = gen.diverged = True
                    continue
                except WorkerBusy as exc:  # the worker holds all it takes: wait here again, nobody is blamed
                    if replaying and not progressed:
                        endpoint.replaying -= 1
                    self.admission.busy(endpoint)
                    busy += 1
                    if busy > cfg.max_recoveries:
                        raise RequestFailed(f"request {gen.rid}: workers answered 429 {busy} times ({exc})") from exc
                    continue
                except WorkerLost as exc:
                    # endpoint.replaying stays raised on this path: the supervisor reads it when
                    # it handles this failure, whichever of us sees the failure first.
                    self.table.report_failure(endpoint, str(exc))
                    gen.recoveries += 1
                    gen.failures.append({"endpoint": f"{endpoint.slot}#{endpoint.instance}", "reason": str(exc), "at_token": len(gen.generated), "t": time.time()})
                    if replaying and not progressed:
                        # It failed the worker it was moved to as well, at the same token: it may
                        # be what kills workers. End it here rather than replay it into a third.
                        raise RequestFailed(
                            f"request {gen.rid} failed on two workers in a row at token {len(gen.generated)} "
                            f"({exc}); not replayed again") from exc
                    after_worker_failure = True
                    log.info("request %s: %s lost at token %d (%s); resuming", gen.rid, endpoint, len(gen.generated), exc)
                    if gen.recoveries > cfg.max_recoveries:
                        raise WorkerLost(f"request {gen.rid} gave up after {gen.recoveries} worker failures: {exc}") from exc
                    if len(gen.generated) >= gen.max_new_tokens:
                        gen.finish = {"type": "length", "length": gen.max_new_tokens}
                        yield Chunk(ids=[], text="", finish=gen.finish, meta={})
                        return
                except BaseException:
                    if replaying and not progressed:  # ended here for another reason: not a suspect
                        endpoint.replaying -= 1
                    raise
            finally:
                self.admission.leave(endpoint, tokens)
