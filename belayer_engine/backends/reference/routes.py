"""The reference worker's HTTP routes: SGLang's native API and ``/belayer/*`` over
:class:`WorkerState`, whose scheduler does the work on its own engine thread.

Admission: beyond ``max_running + max_queued`` requests held, a 429. A SIGINT'ed worker
drains (``drain``): it takes nothing new and waits for its running requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid

from aiohttp import web

from belayer_core.errors import ArenaLost, BelayerError, UsageError
from belayer_engine.backends.reference.request import Request
from belayer_engine.backends.reference.sampling import SamplingParams
from belayer_engine.backends.reference.sglang_generate import generate_chunk, parse_generate
from belayer_engine.backends.reference.state import WorkerState
from belayer_engine.common import worker_auth


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class WorkerApp:
    """aiohttp routes; the runtime does the work on its own engine thread."""

    def __init__(self, rt: WorkerState, secret: str | None = None, hang_timeout_s: float = 60.0,
                 max_queued: int = 256):
        self.rt = rt
        self.secret = secret
        self.hang_timeout_s = hang_timeout_s
        self.max_queued = max_queued  # beyond max_running + this: 429, so no client can bury the event loop
        self.live: dict[str, Request] = {}
        self.draining = False  # SIGINT: finish what runs, take nothing new
        self._idle = asyncio.Event()  # set whenever ``live`` is empty (what a drain waits for)
        self._idle.set()
        app = web.Application(client_max_size=64 << 20, middlewares=[self._auth])
        app.add_routes([
            web.post("/generate", self.generate),
            web.get("/health", self.health),
            web.get("/health_generate", self.health_generate),
            web.get("/get_model_info", self.model_info),
            web.get("/get_server_info", self.server_info),
            web.post("/flush_cache", self.flush_cache),
            web.get("/flush_cache", self.flush_cache),
            web.post("/abort_request", self.abort_request),
            web.post("/belayer/activate", self.activate),
            web.get("/belayer/state", self.state),
        ])
        self.app = app

    # ------------------------------------------------------------------ helpers
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """Every route needs the engine's secret when the worker was started with one."""
        if not worker_auth.authorized(request.headers.get("Authorization"), self.secret):
            return _error(401, "this worker serves only its engine (missing or wrong secret)")
        return await handler(request)

    def _unavailable(self) -> web.Response | None:
        if self.draining:  # only reachable over a kept-alive connection: the listener is closed
            return web.json_response({"status": "draining", "error": {
                "message": "worker is draining after SIGINT: not taking new requests"}}, status=503)
        if self.rt.state != "active":
            return web.json_response({"status": "shadow", "error": {
                "message": "shadow worker: not serving until POST /belayer/activate"}}, status=503)
        if not self.rt.arena_ok:
            return web.json_response({"status": "arena_lost", "error": {
                "message": "the arena server is gone"}}, status=503)
        return None

    # ------------------------------------------------------------------ routes
    async def generate(self, request: web.Request) -> web.StreamResponse:
        if (resp := self._unavailable()) is not None:
            return resp
        try:
            g = parse_generate(await request.read(), self.rt.tokenizer, self.rt.cfg.vocab_size)
        except UsageError as exc:
            return _error(400, str(exc))
        held = self.rt.scheduler.max_running + self.max_queued
        if len(self.live) >= held:
            return _error(429, f"worker holds {len(self.live)} requests, its most (max_running "
                               f"{self.rt.scheduler.max_running} + max_queued {self.max_queued}): retry later")
        rid = g.rid or uuid.uuid4().hex
        if rid in self.live:
            return _error(400, f"request id {rid!r} is already running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[dict] = asyncio.Queue()
        req = Request(rid, list(g.input_ids), g.sampling_params,
                      lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        if g.return_logprob:
            req.logprobs, req.top_logprobs_num = [], g.top_logprobs_num
            req.top_logprobs = [] if g.top_logprobs_num else None
            req.logprob_texts = {} if g.return_text_in_logprobs else None
        try:
            self.rt.scheduler.submit(req)
        except UsageError as exc:
            return _error(400, str(exc))
        self.live[rid] = req
        self._idle.clear()
        try:
            if not g.stream:
                while (ev := await q.get())["finish_reason"] is None:
                    pass
                return web.json_response(generate_chunk(req, ev, self.rt.tokenizer))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            while True:
                ev = await q.get()
                await resp.write(b"data: " + json.dumps(generate_chunk(req, ev, self.rt.tokenizer)).encode() + b"\n\n")
                if ev["finish_reason"] is not None:
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.rt.scheduler.abort(rid)  # the client went away: free its KV
            raise
        finally:
            self.live.pop(rid, None)
            if not self.live:
                self._idle.set()

    async def health(self, request: web.Request) -> web.Response:
        if (resp := self._unavailable()) is not None:
            return resp
        stuck = self.rt.scheduler.stuck_s()
        if stuck > self.hang_timeout_s:
            return web.json_response({"status": "hung", "error": {
                "message": f"the scheduler has been inside one step for {stuck:.0f}s"}}, status=503)
        return web.json_response({"status": "ok", "weight_version": self.rt.weight_version})

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang's one-token probe (writes KV, so a shadow refuses it)."""
        if (resp := self._unavailable()) is not None:
            return resp
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def emit(ev):
            if ev["finish_reason"] is not None:
                loop.call_soon_threadsafe(done.set_result, ev)

        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        self.rt.scheduler.submit(Request(f"health-{uuid.uuid4().hex}", [0], params, emit))
        try:
            await asyncio.wait_for(done, 20)
        except TimeoutError:
            return _error(503, "health generation timed out")
        return web.json_response({"status": "ok"})

    async def model_info(self, request: web.Request) -> web.Response:
        rt = self.rt
        return web.json_response({
            "model_path": rt.info.get("model_path") or "belayer-seeded",
            "tokenizer_path": None, "is_generation": True,
            "weight_version": rt.weight_version, "model": rt.cfg.to_dict()})

    async def server_info(self, request: web.Request) -> web.Response:
        rt = self.rt
        return web.json_response({
            "version": "belayer-engine-0.1", "worker_id": rt.worker_id, "pid": rt.pid,
            "state": rt.state, "device": str(rt.device), "weight_version": rt.weight_version,
            "max_running_requests": rt.scheduler.max_running, "page_size": rt.block_size,
            "num_blocks": rt.info["kv"]["num_blocks"], "arena_ok": rt.arena_ok,
            "init_s": rt.init_s, **rt.scheduler.load()})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.rt.state != "active" or self.rt.scheduler.flush():
            return web.json_response({"status": "flushed"})
        return _error(400, "cache not flushed: requests are in flight")

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            return _error(400, "body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object with 'rid' or 'abort_all'")
        if body.get("abort_all"):
            self.rt.scheduler.abort(None)
            return web.json_response({"aborted": "all"})
        rid = body.get("rid")
        if not isinstance(rid, str):
            return _error(400, "give 'rid' (a string) or 'abort_all': true")
        self.rt.scheduler.abort(rid)
        return web.json_response({"aborted": [rid], "found": rid in self.live})

    async def activate(self, request: web.Request) -> web.Response:
        try:
            took = await asyncio.get_running_loop().run_in_executor(None, self.rt.activate)
        except UsageError as exc:
            return _error(409, str(exc))
        except (ArenaLost, BelayerError) as exc:
            return _error(503, str(exc))
        return web.json_response({"status": "active", "activate_s": took})

    async def state(self, request: web.Request) -> web.Response:
        rt = self.rt
        return web.json_response({"state": rt.state, "worker_id": rt.worker_id, "pid": rt.pid,
                                  "weight_version": rt.weight_version, "device": str(rt.device),
                                  "arena_ok": rt.arena_ok})

    async def drain(self, timeout: float) -> bool:
        """Take no new request and wait (at most ``timeout``) until the running ones end;
        True when none is left."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return not self.live
