"""One streamed ``POST /generate`` against one worker (SGLang's native protocol).

Turns the worker's cumulative ``output_ids`` into deltas, and tells a failure of the
request from a failure of the worker by the worker's liveness (``/health``):

- ``WorkerLost`` (the worker is dead, hung or unhealthy: the supervisor hands over):
  connection refused, a stream that breaks or ends without a finish while ``/health``
  fails too, no token within the stall timeout and no ``/health`` answer, or the
  supervisor declaring the endpoint lost (the ``LOST`` sentinel).
- ``UsageError`` / ``RequestFailed`` (this request alone ends; nobody is blamed): a 4xx
  answer, an ``abort`` finish carrying a ``status_code`` (SGLang's shape for an error
  inside one request), an abort or broken stream while the worker answers ``/health``,
  and a stream silent for ``max_silence`` while the worker stays healthy.
- ``WorkerBusy`` (429: the worker holds all it takes): the generation waits in the router
  again (``admission.py``); nobody is blamed.

A silent stream is not a stalled worker while the worker sends other streams tokens: a
busy worker is slow to answer ``/health`` (its event loop serves every stream), and once
that was taken for a stall and the busy worker handed over (issue 47, item 4). So the
``/health`` probe runs only when the whole endpoint has sent nothing for ``stall_timeout``
(``progressed_within``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from belayer_core.errors import RequestFailed, UsageError, WorkerLost
from belayer_engine.common.json_body import encode_json
from belayer_engine.common.routing import LOST, Endpoint
from belayer_engine.common.sse import sse_json

_DONE = object()
_JSON = {"Content-Type": "application/json"}
_last_chunk: weakref.WeakKeyDictionary[Endpoint, float] = weakref.WeakKeyDictionary()  # monotonic


class WorkerBusy(Exception):
    """The worker answered 429: it holds all it takes (not a failure of anyone)."""


def progressed_within(endpoint: Endpoint, seconds: float) -> bool:
    """True when ``endpoint`` sent any of its streams a chunk in the last ``seconds``."""
    at = _last_chunk.get(endpoint)
    return at is not None and time.monotonic() - at < seconds


@dataclass
class Chunk:
    """New token ids since the previous chunk, the worker's text so far, and the finish.

    With ``return_logprob`` in the body, ``logprobs`` (and ``top`` with ``top_logprobs_num``)
    hold one entry per id of ``ids``: the sampled token's logprob, and the top (logprob, id).
    """

    ids: list[int]
    text: str
    finish: dict | None
    meta: dict
    logprobs: list[float] | None = None
    top: list[list[tuple[float, int]]] | None = None


NEG_INF_LOGPROB = -9999.0  # what a worker's -inf (JSON null) becomes, as OpenAI reports it


def _lp(value) -> float:
    return float(value) if isinstance(value, int | float) else NEG_INF_LOGPROB


def _logprob_slice(meta: dict, start: int, count: int, top: bool) -> tuple[list[float], list | None]:
    """The logprobs of output tokens [start, start + count) from SGLang's cumulative
    ``output_token_logprobs`` / ``output_top_logprobs`` (entries ``[logprob, id, text]``)."""
    entries = (meta.get("output_token_logprobs") or [])[start : start + count]
    if len(entries) != count:
        raise RequestFailed(f"the worker sent {start + count} token ids but "
                            f"{len(meta.get('output_token_logprobs') or [])} logprobs")
    lps = [_lp(e[0]) for e in entries]
    if not top:
        return lps, None
    tops = (meta.get("output_top_logprobs") or [])[start : start + count]
    if len(tops) != count:
        raise RequestFailed("the worker sent fewer top logprobs than token ids")
    return lps, [[(_lp(e[0]), int(e[1])) for e in row or ()] for row in tops]


async def _pump(session: aiohttp.ClientSession, endpoint: Endpoint, body: dict, queue: asyncio.Queue,
                connect_timeout: float, on_headers: Callable[[], None] | None = None) -> None:
    """Read the SSE stream into ``queue``; errors are queued, never raised."""
    try:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, connect=connect_timeout)
        async with session.post(endpoint.url + "/generate", data=encode_json(body), headers=_JSON,
                                timeout=timeout) as resp:
            if on_headers is not None:
                on_headers()
            if resp.status >= 400:
                text = await resp.text()
                if resp.status == 429:
                    queue.put_nowait(WorkerBusy(f"worker answered 429: {text[:200]}"))
                elif 400 <= resp.status < 500 and resp.status != 408:
                    queue.put_nowait(UsageError(f"worker rejected the request ({resp.status}): {text[:500]}"))
                else:
                    queue.put_nowait(WorkerLost(f"worker answered {resp.status}: {text[:200]}"))
                return
            async for chunk in sse_json(resp.content, "worker"):
                _last_chunk[endpoint] = time.monotonic()
                queue.put_nowait(chunk)
            queue.put_nowait(_DONE)
    except asyncio.CancelledError:
        raise
    except WorkerLost as exc:
        queue.put_nowait(exc)
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        queue.put_nowait(WorkerLost(f"stream broken: {type(exc).__name__}: {exc}"))


def _request_error(finish: dict, healthy: bool) -> Exception:
    """The error for an ``abort`` finish: the request's own, or the worker's."""
    message = f"the worker ended the request: {finish.get('message') or finish}"
    code = finish.get("status_code")
    if isinstance(code, int) and 400 <= code < 500:
        return UsageError(message)
    if isinstance(code, int) or healthy:
        return RequestFailed(message)
    return WorkerLost(f"worker aborted the request and fails /health: {finish}")


async def _answers_health(session: aiohttp.ClientSession, endpoint: Endpoint, timeout: float) -> bool:
    """A stopped (SIGSTOP) or wedged worker does not answer; a merely busy one does."""
    if endpoint.lost:
        return False
    try:
        async with session.get(endpoint.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def stream_generate(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    body: dict,
    *,
    stall_timeout: float,
    connect_timeout: float,
    probe_timeout: float = 2.0,
    max_silence: float = 300.0,
    on_headers: Callable[[], None] | None = None,
) -> AsyncIterator[Chunk]:
    """Yield ``Chunk``s of one generation; raise ``WorkerLost`` on any worker failure.
    ``on_headers`` is called when the worker's answer starts (its HTTP side took the request)."""
    queue: asyncio.Queue = asyncio.Queue()
    endpoint.streams.add(queue)
    endpoint.inflight += 1
    if endpoint.lost:
        queue.put_nowait(LOST)
    pump = asyncio.create_task(_pump(session, endpoint, body, queue, connect_timeout, on_headers))
    seen = 0
    want_logprobs, want_top = bool(body.get("return_logprob")), bool(body.get("top_logprobs_num"))
    finished = False
    silent = 0.0
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), stall_timeout)
            except TimeoutError:
                silent += stall_timeout
                if not progressed_within(endpoint, stall_timeout) and not await _answers_health(
                        session, endpoint, probe_timeout):
                    raise WorkerLost(f"stalled: no token for {silent:.1f}s and no /health answer") from None
                if silent >= max_silence:  # the worker is fine; this one request is stuck
                    raise RequestFailed(f"no token for {silent:.0f}s while the worker stays healthy; request ended") from None
                continue  # slow (queued, long prefill), not stalled: keep waiting
            silent = 0.0
            if item is LOST:
                raise WorkerLost("endpoint declared lost")
            if item is _DONE and not finished or isinstance(item, WorkerLost):
                reason = "[DONE] without a finish reason" if item is _DONE else str(item)
                if await _answers_health(session, endpoint, probe_timeout):
                    raise RequestFailed(f"the worker's stream for this request broke ({reason}) while the worker stays healthy")
                raise WorkerLost(reason)
            if item is _DONE:
                return
            if isinstance(item, Exception):
                raise item
            if "error" in item:  # SGLang: an error inside a 200 stream, e.g. a prompt too long
                err = item["error"] if isinstance(item["error"], dict) else {"message": str(item["error"])}
                raise _request_error({"message": err.get("message"), "status_code": err.get("code")},
                                     await _answers_health(session, endpoint, probe_timeout))
            meta = item.get("meta_info") or {}
            ids = list(item.get("output_ids") or [])
            start = seen
            delta, seen = ids[seen:], max(seen, len(ids))  # chunks may skip tokens: diff, never count
            finish = meta.get("finish_reason")
            if finish and finish.get("type") == "abort":
                raise _request_error(finish, await _answers_health(session, endpoint, probe_timeout))
            lps, top = _logprob_slice(meta, start, len(delta), want_top) if want_logprobs else (None, None)
            yield Chunk(ids=delta, text=item.get("text") or "", finish=finish, meta=meta, logprobs=lps, top=top)
            if finish:
                finished = True
    finally:
        endpoint.streams.discard(queue)
        endpoint.inflight -= 1
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await pump
