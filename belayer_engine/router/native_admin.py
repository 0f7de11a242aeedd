"""SGLang's control routes on the router: info, health, cache, weights, memory.

Served with SGLang 0.5.23's paths and bodies so that a trainer's calls to an SGLang server
reach the engine unchanged. Weight updates become ONE engine-wide version through the
supervisor (``control``: every slot, its shadow, and any later cold restart serve it; see
``supervisor/weights.py``); a router over fixed workers or a Ray engine has no such control
and answers 501 for them. Routes the engine cannot serve answer 501 naming why, never a silent 200.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from aiohttp import web

from belayer_core.errors import BelayerError, StaleWeightVersion, UsageError
from belayer_engine.common.routing import RoutingTable

from .native_api import failure_status, native_error
from .recovery import Continuation, Generation
from .requests import parse_json

# update_weights_from_disk fields that change nothing here, and those accepted only neutral
_DISK_IGNORED = {"flush_cache", "torch_empty_cache", "token_step", "recapture_cuda_graph"}
_DISK_NEUTRAL = {"load_format": (None, "auto", "safetensors"), "abort_all_requests": (False, True), "is_async": (False,),
                 "keep_pause": (False,), "manifest": (None,)}
_LOAD_SECTIONS = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
_TENSOR_NEUTRAL = {"load_format": (None,), "abort_all_requests": (False, True), "selector": ("all", "target")}


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
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/update_weights_from_tensor", self.update_weights_from_tensor),
            web.get("/v1/loads", self.loads),
            web.post("/release_memory_occupation", self.memory_occupation),
            web.post("/resume_memory_occupation", self.memory_occupation),
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
            "internal_states": [{"slot": e.slot, "pid": e.pid, "device": e.device, "inflight": e.inflight}
                                for e in live],
            "workers": self.table.snapshot()})

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's ``GET /v1/loads`` (``include``, ``dp_rank``; JSON): the engine is one DP
        rank; ``core`` holds what the router knows (requests running on live workers, requests
        held by ``/pause_generation``), no other section. slime polls it after an abort."""
        query = request.rel_url.query
        include = {s.strip() for s in query.get("include", "").split(",") if s.strip()}
        if include - _LOAD_SECTIONS:
            return native_error(400, f"Invalid include sections: {sorted(include - _LOAD_SECTIONS)}. "
                                     f"Valid options: {sorted(_LOAD_SECTIONS)}")
        if query.get("format", "json") != "json":
            return native_error(400, "format: only json is served (no prometheus text on the engine)")
        live = [e for e in self.table.endpoints() if not e.lost]
        load = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": sum(e.inflight for e in live),
                "num_waiting_reqs": self.native.held if self.native is not None else 0}
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

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """SGLang's body (``model_path``, optional ``weight_version``): the checkpoint's
        safetensors become one engine-wide version (a decimal ``weight_version`` picks it)."""
        async def tensors(body: dict) -> dict:
            path = body.get("model_path")
            if not isinstance(path, str) or not path:
                raise UsageError("model_path: a directory with the checkpoint's *.safetensors")
            layout, dtype = await self.control.weight_layout()
            from belayer_engine.weights.disk import load_checkpoint  # torch: only when asked

            return await asyncio.to_thread(load_checkpoint, Path(path), layout, dtype)

        return await self._update(request, {"model_path", *_DISK_IGNORED}, _DISK_NEUTRAL, tensors)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's body (``serialized_named_tensors``: base64 ``ForkingPickler`` pickles of
        (name, tensor) pairs; shared-memory handles, decoded by an allowlist of torch's rebuild
        functions only) becomes one engine-wide version, like ``update_weights_from_disk``."""
        async def tensors(body: dict) -> dict:
            from belayer_engine.weights.tensor import decode_named_tensors  # torch: only when asked

            return await asyncio.to_thread(decode_named_tensors, body.get("serialized_named_tensors"))

        return await self._update(request, {"serialized_named_tensors", *_DISK_IGNORED}, _TENSOR_NEUTRAL, tensors)

    async def _update(self, request: web.Request, fields: set[str], neutral: dict, tensors) -> web.Response:
        if self.control is None:
            return _weights_answer(False, "this router has no engine-wide weight control: it serves fixed workers "
                                   "(`belayer serve router`: update them directly) or a Ray engine "
                                   "(RayEngine.update_weights)", 501)
        try:
            body = parse_json(await request.read())
            if not isinstance(body, dict):
                raise UsageError("body must be a JSON object")
            unknown = sorted(set(body) - {"weight_version", *fields, *neutral})
            if unknown:
                raise UsageError(f"unknown field(s) {unknown}")
            for key, ok in neutral.items():
                if key in body and body[key] not in ok:
                    raise UsageError(f"{key}: not supported by this engine (only {ok!r} accepted)")
            version = _parse_version(body.get("weight_version"))
            state = await tensors(body)
            if body.get("abort_all_requests") is True and self.native is not None:  # AReaL sends it
                for run in list(self.native.running.values()):
                    run.aborted.set()
            applied = await asyncio.shield(self.control.update_weights(state, version=version))
        except BelayerError as exc:
            status = 409 if isinstance(exc, StaleWeightVersion) else failure_status(exc)
            return _weights_answer(False, f"{type(exc).__name__}: {exc}", status)
        return _weights_answer(True, f"Succeeded to update model weights. Weight version updated to {applied}.", 200)

    async def memory_occupation(self, request: web.Request) -> web.Response:
        return native_error(501, (
            f"{request.path.strip('/')} is not served by the engine: its arenas own the weights and "
            "KV memory and its shadows already hold no copy of the weights; releasing a serving "
            "worker's memory would stop the slot's recovery"))


def _weights_answer(success: bool, message: str, status: int) -> web.Response:
    return web.json_response({"success": success, "message": message, "num_paused_requests": 0}, status=status)


def _parse_version(value) -> int | None:
    """SGLang's ``weight_version`` is a string; the engine's versions are ints."""
    if value is None:
        return None
    text = str(value) if type(value) is int else value
    if not isinstance(text, str) or not text.isdigit() or int(text) < 1:
        raise UsageError(f"weight_version: a positive integer (as a string), got {value!r}")
    return int(text)
