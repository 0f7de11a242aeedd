"""One streamed ``POST /generate`` against one worker (SGLang's native protocol).

Turns the worker's cumulative ``output_ids`` into deltas and every way a worker can fail
into one typed error, ``WorkerLost``: connection refused, a stream that ends without a
finish reason or ``[DONE]``, an ``abort`` finish, no token within the stall timeout, or the
supervisor declaring the endpoint lost (the ``LOST`` sentinel). A silent stream is only
declared stalled when the worker does not answer ``/health`` either, so a busy worker
(long queue, long prefill) is never fenced for being slow.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from belayer.errors import UsageError, WorkerLost
from belayer_engine.routing import LOST, Endpoint
from belayer_engine.sse import sse_json

_DONE = object()


@dataclass
class Chunk:
    """New token ids since the previous chunk, the worker's text so far, and the finish."""

    ids: list[int]
    text: str
    finish: dict | None
    meta: dict


async def _pump(session: aiohttp.ClientSession, url: str, body: dict, queue: asyncio.Queue, connect_timeout: float) -> None:
    """Read the SSE stream into ``queue``; errors are queued, never raised."""
    try:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, connect=connect_timeout)
        async with session.post(url + "/generate", json=body, timeout=timeout) as resp:
            if resp.status >= 400:
                text = await resp.text()
                if 400 <= resp.status < 500 and resp.status not in (408, 429):
                    queue.put_nowait(UsageError(f"worker rejected the request ({resp.status}): {text[:500]}"))
                else:
                    queue.put_nowait(WorkerLost(f"worker answered {resp.status}: {text[:200]}"))
                return
            async for chunk in sse_json(resp.content, "worker"):
                queue.put_nowait(chunk)
            queue.put_nowait(_DONE)
    except asyncio.CancelledError:
        raise
    except WorkerLost as exc:
        queue.put_nowait(exc)
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        queue.put_nowait(WorkerLost(f"stream broken: {type(exc).__name__}: {exc}"))


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
) -> AsyncIterator[Chunk]:
    """Yield ``Chunk``s of one generation; raise ``WorkerLost`` on any worker failure."""
    queue: asyncio.Queue = asyncio.Queue()
    endpoint.streams.add(queue)
    endpoint.inflight += 1
    if endpoint.lost:
        queue.put_nowait(LOST)
    pump = asyncio.create_task(_pump(session, endpoint.url, body, queue, connect_timeout))
    seen = 0
    finished = False
    silent = 0.0
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), stall_timeout)
            except TimeoutError:
                silent += stall_timeout
                if silent < max_silence and await _answers_health(session, endpoint, probe_timeout):
                    continue  # slow (queued, long prefill), not stalled: keep waiting
                raise WorkerLost(f"stalled: no token for {silent:.1f}s and no /health answer") from None
            silent = 0.0
            if item is LOST:
                raise WorkerLost("endpoint declared lost")
            if item is _DONE:
                if not finished:
                    raise WorkerLost("[DONE] without a finish reason")
                return
            if isinstance(item, Exception):
                raise item
            meta = item.get("meta_info") or {}
            ids = list(item.get("output_ids") or [])
            delta, seen = ids[seen:], max(seen, len(ids))
            finish = meta.get("finish_reason")
            if finish and finish.get("type") == "abort":
                raise WorkerLost(f"worker aborted the request: {finish}")
            yield Chunk(ids=delta, text=item.get("text") or "", finish=finish, meta=meta)
            if finish:
                finished = True
    finally:
        endpoint.streams.discard(queue)
        endpoint.inflight -= 1
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await pump
