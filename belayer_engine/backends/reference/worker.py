"""Reference inference worker: SGLang's native HTTP protocol over :class:`WorkerState`.

``python -m belayer_engine.backends.reference.worker --arena-socket PATH [--host 127.0.0.1] --port N
[--shadow] [--worker-id ID]`` (also ``belayer serve worker``). Routes and fields are
documented in docs/engine.md; the contract with the router is docs/contracts.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
import uuid
from typing import Literal, NoReturn

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from belayer_core.errors import ArenaLost, BelayerError, UsageError
from belayer_engine.backends.reference.config import FLAGS, WorkerConfig, add_flags
from belayer_engine.backends.reference.sampling import MAX_TOP_LOGPROBS, SamplingParams
from belayer_engine.backends.reference.scheduler import Request
from belayer_engine.backends.reference.state import WorkerState
from belayer_engine.common import owner, worker_auth
from belayer_engine.common.json_body import parse_json_object


class GenerateRequest(BaseModel):
    """SGLang ``/generate`` body (single request). Unknown fields (SGLang features this
    worker does not implement: input-token logprobs, LoRA, images, ...) are refused by name.

    ``return_logprob`` / ``top_logprobs_num`` add SGLang's ``meta_info``
    ``output_token_logprobs`` ([logprob, id, text|None] per output token) and
    ``output_top_logprobs`` (a list of such entries per output token), cumulative in a
    stream like ``output_ids``. Input-token logprobs are not computed: ``logprob_start_len``
    may only be -1 (SGLang's default) and ``input_token_logprobs`` (``input_top_logprobs``)
    are empty, as SGLang's own are with that default.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: Literal[-1] = -1
    return_text_in_logprobs: bool = False


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "body"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


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

    def _chunk(self, req: Request, ev: dict) -> dict:
        p = req.params
        text = self.rt.tokenizer.decode(ev["output_ids"], skip_special_tokens=p.skip_special_tokens)
        fr = ev["finish_reason"]
        if fr and isinstance(fr.get("matched"), str) and not p.no_stop_trim:
            cut = text.find(fr["matched"])
            text = text[:cut] if cut >= 0 else text
        return {"text": text, "output_ids": ev["output_ids"], "meta_info": {
            "id": req.rid, "finish_reason": fr, "prompt_tokens": len(req.prompt),
            "completion_tokens": len(ev["output_ids"]), "cached_tokens": 0,
            "weight_version": ev["weight_version"],
            "weight_version_start": ev["weight_version_start"],
            "e2e_latency": time.time() - req.created, **self._logprobs(req, ev)}}

    def _logprobs(self, req: Request, ev: dict) -> dict:
        """SGLang's logprob fields of one event (nothing when they were not asked for)."""
        if "logprobs" not in ev:
            return {}
        n = len(ev["logprobs"])
        texts = req.logprob_texts
        if texts is not None:  # return_text_in_logprobs: decode each token once
            decode = self.rt.tokenizer.decode
            texts.update({i: decode([i], skip_special_tokens=False) for i in ev["output_ids"][:n] if i not in texts})
            for top in ev["top_logprobs"] or ():
                texts.update({i: decode([i], skip_special_tokens=False) for _, i in top if i not in texts})
        name = (lambda i: texts[i]) if texts is not None else (lambda i: None)
        out = {"input_token_logprobs": [],
               "output_token_logprobs": [[lp, i, name(i)] for lp, i in zip(ev["logprobs"], ev["output_ids"][:n], strict=True)],
               "output_token_logprobs_length": n}
        if ev["top_logprobs"] is not None:
            out["input_top_logprobs"] = []
            out["output_top_logprobs"] = [[[lp, i, name(i)] for lp, i in top] for top in ev["top_logprobs"]]
        return out

    async def _parse(self, request: web.Request) -> GenerateRequest:
        body = parse_json_object(await request.read(), "body must be a JSON object (batched requests are not supported)")
        try:
            g = GenerateRequest.model_validate(body)
        except ValidationError as exc:
            raise UsageError(_validation_message(exc)) from exc
        if (g.text is None) == (g.input_ids is None):
            raise UsageError("give exactly one of 'text' or 'input_ids'")
        ids = g.input_ids if g.input_ids is not None else self.rt.tokenizer.encode(g.text)
        if not ids:
            raise UsageError("the prompt is empty")
        vocab = self.rt.cfg.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UsageError(f"input_ids out of range [0, {vocab}): {bad[:5]}")
        g.input_ids = ids
        return g

    # ------------------------------------------------------------------ routes
    async def generate(self, request: web.Request) -> web.StreamResponse:
        if (resp := self._unavailable()) is not None:
            return resp
        try:
            g = await self._parse(request)
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
                return web.json_response(self._chunk(req, ev))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(request)
            while True:
                ev = await q.get()
                await resp.write(b"data: " + json.dumps(self._chunk(req, ev)).encode() + b"\n\n")
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


DRAIN_S = 5.0  # a SIGINT'ed worker finishes its running requests for at most this long
_CUT_S = 0.5  # then aiohttp gets this long to cancel what still runs and close the connections


def run(args: argparse.Namespace) -> NoReturn:
    cfg = FLAGS.build(args)
    owner.watch_owner(lambda: os._exit(1), death_signal=signal.SIGKILL)  # never outlive the engine
    secret = worker_auth.take_from_env()
    if secret is None:
        print(f"warning: {worker_auth.ENV} not set: every local user can use this worker", file=sys.stderr)
    rt = WorkerState(cfg.arena_socket, cfg.worker_id, cfg.shadow, cfg.threads,
                       cfg.max_running, cfg.max_prefill_tokens, tokenizer_dir=cfg.tokenizer_dir)
    code = asyncio.run(_serve(WorkerApp(rt, secret, cfg.hang_timeout_s, cfg.max_queued), cfg))
    # Listener, connections, engine thread and arena attachment are closed: leave without the
    # interpreter's teardown (torch's takes seconds on a loaded machine, and a thread still
    # inside torch can abort it), so the supervisor sees this clean exit promptly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(worker: WorkerApp, cfg: WorkerConfig) -> int:
    """Serve until SIGINT, then drain: close the listener, let running requests finish for
    at most DRAIN_S, cut the rest (the router continues them on the shadow token by token),
    stop the engine thread and return 0.

    SIGINT is the loop's own handler, not asyncio.run's: (1) asyncio.run installs none when
    SIGINT was inherited ignored, as by every child of an engine started as a background job
    of a shell script; such a worker ignored SIGINT and kept serving, so nothing replaced it.
    (2) asyncio.run's handler cancels this task, and aiohttp's graceful shutdown inside a
    cancelled task re-raises at its first timeout: the runner was left half torn down and
    the engine thread inside torch while the interpreter exited ("terminate called without
    an active exception", exit -6). The loop's handler also wakes the loop through its
    wakeup fd, whichever thread the kernel delivered the signal to.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stop.set)  # before "ready": a caller may signal at once
    # handler_cancellation: a client gone away aborts its request, streamed or not.
    runner = web.AppRunner(worker.app, access_log=None, handler_cancellation=True, shutdown_timeout=_CUT_S)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    port = runner.addresses[0][1]
    print(json.dumps({"event": "ready", "port": port, "pid": os.getpid(),
                      "state": worker.rt.state, "init_s": worker.rt.init_s}), flush=True)
    try:
        await stop.wait()
        t0 = time.monotonic()
        await site.stop()  # refuse new connections (the supervisor's probes fail from here on)
        print(json.dumps({"event": "draining", "running": len(worker.live)}), flush=True)
        drained = await worker.drain(DRAIN_S)
        print(json.dumps({"event": "drained" if drained else "drain_cut", "cut": len(worker.live),
                          "drain_s": round(time.monotonic() - t0, 3)}), flush=True)
    finally:
        await runner.cleanup()  # cancels what still runs: its stream breaks, it is not finished
        worker.rt.close()
    print(json.dumps({"event": "exit", "code": 0}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m belayer_engine.backends.reference.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    try:
        return run(p.parse_args(argv))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
