"""SGLang's native ``POST /generate`` and ``POST /abort_request`` on the router.

A trainer that talks to an SGLang server (slime, AReaL, miles, ...) talks to the engine
unchanged: one prompt or a batch, ``n`` samples, streamed (cumulative ``output_ids``
chunks, ``data: [DONE]``) or not, with SGLang's response shapes (``NativeRun``). Each
generation is a ``Continuation``: a worker lost mid-generation is continued on the shadow
and the client gets one generation, the ids and logprobs of a fault-free greedy run.
A refused request is a 400 naming the field; a request that no worker can serve is a
503 (500 when it alone failed), as plain HTTP when the stream has not started yet.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from belayer_core.errors import BelayerError, Overloaded, RequestFailed, UsageError

from .native_requests import parse_native
from .native_run import NativeRun
from .recovery import Continuation
from .requests import parse_json
from .tasks import gather_all


def native_error(status: int, message: str) -> web.Response:
    """SGLang's error body: ``{"error": {"message"}}``."""
    return web.json_response({"error": {"message": message}}, status=status)


def failure_status(exc: BelayerError) -> int:
    if isinstance(exc, UsageError):
        return 400
    if isinstance(exc, Overloaded):
        return 429
    return 500 if isinstance(exc, RequestFailed) else 503


class NativeHandlers:
    """``/generate`` and ``/abort_request`` over a ``Continuation``; ``running`` by rid."""

    def __init__(self, continuation: Continuation, codec) -> None:
        self.continuation = continuation
        self.codec = codec
        self.running: dict[str, NativeRun] = {}
        self.resumed = asyncio.Event()  # cleared by /pause_generation, set by /continue_generation
        self.resumed.set()
        self.held = 0  # requests waiting for /continue_generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            req = parse_native(parse_json(await request.read()), self.codec.encode)
            for item in req.items:
                self.codec.check_ids(item.prompt_ids, "input_ids")
            self.continuation.admission.check_room(len(req.items))
        except BelayerError as exc:
            return native_error(failure_status(exc), str(exc))
        if not self.resumed.is_set():  # SGLang holds new requests while generation is paused
            self.held += 1
            try:
                await self.resumed.wait()
            finally:
                self.held -= 1
        busy = sorted({i.rid for i in req.items if i.rid in self.running})
        if busy:
            return native_error(400, f"rid {busy}: a request with this id is already running")
        group = object()  # its generations are one request in the router's queue
        runs = [NativeRun(item, self.codec, i, group) for i, item in enumerate(req.items)]
        for run in runs:
            self.running[run.item.rid] = run
        try:
            if req.stream:
                return await self._stream(request, runs, req.batched)
            try:
                await gather_all(run.drive(self.continuation) for run in runs)
            except BelayerError as exc:
                return native_error(failure_status(exc), f"{type(exc).__name__}: {exc}")
            out = [_sent(run.payload(final=True)) for run in runs]
            return web.json_response(out if req.batched else out[0])
        finally:
            for run in runs:
                if self.running.get(run.item.rid) is run:
                    del self.running[run.item.rid]

    async def _stream(self, request: web.Request, runs: list[NativeRun], batched: bool) -> web.StreamResponse:
        """Chunks as SGLang sends them; the response starts once every generation has a first
        chunk, so that a request refused by the workers still gets a plain HTTP error."""
        queue: asyncio.Queue = asyncio.Queue()

        async def one(run: NativeRun) -> None:
            async def progress(r: NativeRun) -> None:
                queue.put_nowait(r.payload(final=False, index=r.index if batched else None))

            try:
                await run.drive(self.continuation, progress)
                queue.put_nowait(run.payload(final=True, index=run.index if batched else None))
            except BelayerError as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(run)  # this generation is over

        tasks = [asyncio.create_task(one(run)) for run in runs]
        try:
            pending: list = []
            heard: set[int] = set()
            left = len(runs)
            while len(heard) < len(runs):  # until every generation has said something
                item = await queue.get()
                if isinstance(item, BelayerError):
                    return native_error(failure_status(item), f"{type(item).__name__}: {item}")
                if isinstance(item, NativeRun):
                    left -= 1
                    continue
                heard.add(item.get("index", 0))
                pending.append(item)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if pending:
                _sent(pending[0])
            for item in pending:
                await _write(resp, item)
            while left:
                item = await queue.get()
                if isinstance(item, NativeRun):
                    left -= 1
                elif isinstance(item, BelayerError):
                    await _write(resp, {"error": {"message": f"{type(item).__name__}: {item}", "type": "server_error",
                                                  "code": failure_status(item), "retryable": False}})
                    break
                else:
                    await _write(resp, item)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def abort_request(self, request: web.Request) -> web.Response:
        """SGLang's ``{"rid": str}`` or ``{"abort_all": true}``: the generation ends with an
        ``abort`` finish and the output it had (200, empty body, as SGLang answers)."""
        try:
            body = parse_json(await request.read())
            if not isinstance(body, dict):
                raise UsageError("body must be a JSON object with 'rid' or 'abort_all'")
            unknown = sorted(set(body) - {"rid", "abort_all"})
            if unknown:
                raise UsageError(f"unknown field(s) {unknown}: give 'rid' or 'abort_all'")
            abort_all, rid = body.get("abort_all", False), body.get("rid")
            if type(abort_all) is not bool or not (rid is None or isinstance(rid, str)):
                raise UsageError("rid: a string; abort_all: a bool")
        except UsageError as exc:
            return native_error(400, str(exc))
        for key, run in list(self.running.items()):
            if abort_all or (rid and key == rid):
                run.aborted.set()
        return web.Response(status=200)


    async def pause_generation(self, request: web.Request) -> web.Response:
        """SGLang's ``{"mode": "abort" | "retract" | "in_place"}`` (default abort): new
        requests wait for ``/continue_generation``; ``abort`` also ends the running ones with
        an ``abort`` finish and their output (AReaL re-sends the rest after continuing).
        ``retract`` / ``in_place`` let running ones go on: a weight update reaches them
        between two steps anyway (``weight_versions`` shows where)."""
        try:
            body = parse_json(await request.read() or b"{}")
            if not isinstance(body, dict) or set(body) - {"mode", "rid", "http_worker_ipc"}:
                raise UsageError("body: {'mode': 'abort' | 'retract' | 'in_place'}")
            mode = body.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise UsageError(f"mode: 'abort', 'retract' or 'in_place', got {mode!r}")
        except UsageError as exc:
            return native_error(400, str(exc))
        self.resumed.clear()
        if mode == "abort":
            for run in list(self.running.values()):
                run.aborted.set()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:  # torch_empty_cache: nothing to return to a driver in this process
            body = parse_json(await request.read() or b"{}")
            if not isinstance(body, dict) or set(body) - {"torch_empty_cache", "rid", "http_worker_ipc"}:
                raise UsageError("body: {} or {'torch_empty_cache': bool}")
        except UsageError as exc:
            return native_error(400, str(exc))
        self.resumed.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


def _sent(payload: dict) -> dict:
    payload["meta_info"]["response_sent_to_client_ts"] = time.time()
    return payload


async def _write(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
