"""The router server: an aiohttp app binding the OpenAI handlers to a routing table.

Two ways to feed the table: a ``Supervisor`` (handover, shadows, exclusion) or a fixed
list of worker URLs (e.g. real SGLang servers), which the router probes itself: a lost
worker comes back as a new endpoint once its ``/health`` answers 200 again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import web

from belayer_engine.common import worker_auth
from belayer_engine.common.net import worker_connector
from belayer_engine.common.routing import Endpoint, RoutingTable

from .codec import Codec, load_codec
from .config import RouterConfig
from .native_admin import NativeAdmin
from .native_api import NativeHandlers
from .openai_api import OpenAIHandlers, error_response
from .recovery import Continuation
from .upstream import progressed_within
from .views import workers_view

log = logging.getLogger(__name__)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Every error is a JSON body: aiohttp's own (404, 405, 413) and any bug (500)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(exc.status, exc.reason if not exc.text or exc.text.startswith(f"{exc.status}:") else exc.text, kind)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("router: unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


class Router:
    """OpenAI-compatible front door; call ``start()`` inside a running event loop."""

    def __init__(self, config: RouterConfig | None = None, *, table: RoutingTable | None = None,
                 codec: Codec | None = None, status=None, control=None) -> None:
        self.config = config or RouterConfig()
        self.table = table or RoutingTable()  # shared with a supervisor, or fed by add_static_workers
        self.codec = codec
        self.status = status  # optional callable -> dict (the supervisor's view)
        self.control = control  # the supervisor: SGLang's weight-update routes go through it
        self.base_url: str | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task | None = None
        self._static: dict[str, str] = {}
        self.native: NativeHandlers | None = None  # its running generations (tests read them)

    def add_static_workers(self, urls: list[str]) -> None:
        """Serve fixed worker URLs without a supervisor (the router probes their health)."""
        for i, url in enumerate(urls):
            self._static[f"s{i}"] = url.rstrip("/")
            self.table.add_slot(f"s{i}")

    def build_app(self) -> web.Application:
        cfg = self.config
        if self.codec is None:
            self.codec = load_codec(cfg.tokenizer, cfg.vocab_size)
        self._session = aiohttp.ClientSession(connector=worker_connector(limit=0),
                                              headers=worker_auth.headers(cfg.worker_api_key))
        continuation = Continuation(self.table, self._session, cfg)
        handlers = OpenAIHandlers(continuation, self.codec, cfg.model_name, cfg.default_max_tokens)
        native = self.native = NativeHandlers(continuation, self.codec)
        admin = NativeAdmin(self.table, self._session, continuation, cfg.model_name, cfg.tokenizer, self.control,
                            native)
        app = web.Application(middlewares=[_json_errors, self._auth])
        app.router.add_post("/v1/chat/completions", handlers.chat)
        app.router.add_post("/v1/completions", handlers.completions)
        app.router.add_get("/v1/models", handlers.models)
        # SGLang's native API (docs/router.md, "SGLang's native API")
        app.router.add_post("/generate", native.generate)
        app.router.add_put("/generate", native.generate)
        app.router.add_post("/abort_request", native.abort_request)
        app.router.add_post("/pause_generation", native.pause_generation)
        app.router.add_post("/continue_generation", native.continue_generation)
        app.add_routes(admin.routes())
        app.router.add_get("/health", self._health)
        app.router.add_get("/belayer/workers", self._workers)
        return app

    async def start(self) -> str:
        app = self.build_app()
        # handler_cancellation: a client that goes away cancels its handler, which closes the
        # worker stream, which aborts the request on the worker (streaming or not).
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        sock = site._server.sockets[0]  # the bound port when 0 was asked for
        port = sock.getsockname()[1]
        self.base_url = f"http://{self.config.host}:{port}"
        if self.config.host not in ("127.0.0.1", "localhost", "::1") and not self.config.api_key:
            log.warning("router bound to %s without an API key: anyone who can reach it can use it", self.config.host)
        if self._static:
            self._probe = asyncio.create_task(self._probe_loop())
        log.info("router listening on %s", self.base_url)
        return self.base_url

    async def stop(self) -> None:
        if self._probe:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    # ------------------------------------------------------------------ handlers

    def _authorized(self, request: web.Request) -> bool:
        key = self.config.api_key
        if not key:
            return True
        return worker_auth.bearer_matches(request.headers.get("Authorization"), key)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """Everything but the bare ``/health`` probe needs the key when one is set."""
        if request.path != "/health" and not self._authorized(request):
            return error_response(401, "invalid or missing API key", "authentication_error")
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        """Status for load balancers; the worker count only with the key."""
        live = [e for e in self.table.endpoints() if not e.lost]
        body: dict = {"status": "ok" if live else "degraded"}
        if self._authorized(request):
            body["workers"] = len(live)
        return web.json_response(body, status=200 if live else 503)

    async def _workers(self, request: web.Request) -> web.Response:
        return web.json_response(workers_view(self.table, self.status))

    async def _probe_loop(self) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.connect_timeout_s)
        while True:
            live = {e.slot: e for e in self.table.endpoints() if not e.lost}
            for slot, url in self._static.items():
                ok = False
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with self._session.get(url + "/health", timeout=timeout) as resp:
                        ok = resp.status == 200
                if ok and slot not in live:
                    await self.table.put_in_service(Endpoint(slot=slot, url=url))
                elif not ok and slot in live and not progressed_within(live[slot], self.config.stall_timeout_s):
                    # a worker that sends tokens is busy, not dead, however slow its /health
                    self.table.report_failure(live[slot], "health probe failed")
            await asyncio.sleep(self.config.probe_interval_s)

