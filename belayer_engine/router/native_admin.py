"""SGLang's control routes on the router: info, health, cache, loads, memory (and the weight
routes of ``native_weights.py``).

Served with SGLang 0.5.23's paths and bodies so that a trainer's calls to an SGLang server
reach the engine unchanged. Routes the engine cannot serve answer 501 naming why, never a
silent 200. What they tell about workers names no process (``views.py``).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import aiohttp
from aiohttp import web

from belayer_core.errors import BelayerError
from belayer_engine.common.routing import RoutingTable

from .native_api import native_error
from .native_weights import WeightRoutes
from .recovery import Continuation, Generation
from .views import table_view

_LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


class NativeAdmin:
    """The non-generating SGLang routes; ``control`` is the supervisor (or None)."""

    def __init__(self, table: RoutingTable, session: aiohttp.ClientSession, continuation: Continuation,
                 model_name: str, model_path: str | None, control=None, native=None) -> None:
        self.table = table
        self.session = session
        self.continuation = continuation
        self.model_name = model_name
        self.model_path = model_path
        self.control = control
        self.native = native  # NativeHandlers: abort_all_requests ends its running generations

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/health_generate", self.health_generate),
            web.get("/model_info", self.model_info), web.get("/get_model_info", self.model_info),
            web.get("/server_info", self.server_info), web.get("/get_server_info", self.server_info),
            web.post("/flush_cache", self.flush_cache), web.get("/flush_cache", self.flush_cache),
            web.get("/v1/loads", self.loads),
            web.post("/release_memory_occupation", self.memory_occupation),
            web.post("/resume_memory_occupation", self.memory_occupation),
            *WeightRoutes(self.control, self.native).routes(),
        ]

    def _version(self) -> str:
        return str(self.control.weights.version) if self.control is not None else "default"

    async def health_generate(self, request: web.Request) -> web.Response:
        """One greedy token from ``[0]`` through a live worker (never a shadow: only the
        routing table's workers are used), as SGLang's probe."""
        gen = Generation(prompt_ids=[0], max_new_tokens=1, sampling={"temperature": 0.0})
        chunks = self.continuation.run(gen)
        try:
            async for _ in chunks:
                pass
        except BelayerError as exc:
            return native_error(503, f"health generation failed: {type(exc).__name__}: {exc}")
        finally:
            await chunks.aclose()
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path or self.model_name, "served_model_name": self.model_name,
            "tokenizer_path": self.model_path, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self._version(), "load_format": None, "reasoning_parser": None,
            "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})

    async def server_info(self, request: web.Request) -> web.Response:
        """The engine's view in SGLang's envelope: ``internal_states`` lists the workers."""
        live = [e for e in self.table.endpoints() if not e.lost]
        return web.json_response({
            "model_path": self.model_path or self.model_name, "served_model_name": self.model_name,
            "weight_version": self._version(), "version": "belayer-engine", "frontend": "belayer",
            "internal_states": [{"slot": e.slot, "device": e.device, "inflight": e.inflight}
                                for e in live],
            "workers": table_view(self.table)})

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's ``GET /v1/loads`` (``include``, ``dp_rank``; JSON): the engine is one DP
        rank; ``core`` holds what the router knows (requests running on live workers, requests
        held by ``/pause_generation`` or waiting for a worker with room), no other section.
        slime polls it after an abort."""
        query = request.rel_url.query
        include = {s.strip() for s in query.get("include", "").split(",") if s.strip()}
        if include - _LOAD_SECTIONS:
            return native_error(400, f"Invalid include sections: {sorted(include - _LOAD_SECTIONS)}. "
                                     f"Valid options: {sorted(_LOAD_SECTIONS)}")
        if query.get("format", "json") != "json":
            return native_error(400, "format: only json is served (no prometheus text on the engine)")
        live = [e for e in self.table.endpoints() if not e.lost]
        load = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": sum(e.inflight for e in live),
                "num_waiting_reqs": (self.native.held if self.native is not None else 0)
                + self.continuation.admission.waiting}
        wanted = query.get("dp_rank")
        return web.json_response({
            "timestamp": datetime.now(UTC).isoformat(), "version": "belayer-engine", "accelerator": None,
            "num_accelerators": len(live), "loads": [load] if wanted in (None, "0") else []})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """Forwarded to every live worker; 400 when one refuses (requests in flight)."""
        refused = []
        for ep in [e for e in self.table.endpoints() if not e.lost]:
            try:
                async with self.session.post(ep.url + "/flush_cache", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    if resp.status != 200:
                        refused.append(f"{ep.slot}: {resp.status} {(await resp.text())[:200]}")
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                refused.append(f"{ep.slot}: {type(exc).__name__}")
        if refused:
            return web.Response(status=400, text=f"Flush cache failed: {'; '.join(refused)}\n")
        return web.Response(status=200, text="Cache flushed.\n")

    async def memory_occupation(self, request: web.Request) -> web.Response:
        return native_error(501, (
            f"{request.path.strip('/')} is not served by the engine: its arenas own the weights and "
            "KV memory and its shadows already hold no copy of the weights; releasing a serving "
            "worker's memory would stop the slot's recovery"))

