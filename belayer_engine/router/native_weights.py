"""SGLang's weight-update routes on the router: ``/update_weights_from_disk`` and
``/update_weights_from_tensor``, each one engine-wide version through the supervisor.

``control`` (the supervisor) makes a version ONE engine-wide version: every slot, its
shadow and any later cold restart serve it (``weights/sync.py``). A router over fixed
workers or a Ray engine has no such control and answers 501.

What a request can cost is bounded before it is read: one update is received, decoded and
applied at a time (``_WAITING`` more may wait; beyond that 429), its body may not exceed
what the served model's tensors take in base64 (413 naming the limit), and the body is
parsed and decoded in a thread, so the event loop (``/health``, every stream) never waits
on it. The tensor route takes tensors by value only (``weights/tensor.py``): it never opens
a file or a socket a request names.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from aiohttp import web

from belayer_core.errors import BelayerError, StaleWeightVersion, UsageError
from belayer_engine.common.json_body import parse_json_object
from belayer_engine.weights.tensor import FIELD, max_entry_bytes
from belayer_engine.weights.wire import SIZES

from .native_api import failure_status

# update_weights_from_disk fields that change nothing here, and those accepted only neutral
_DISK_IGNORED = {"flush_cache", "torch_empty_cache", "token_step", "recapture_cuda_graph"}
_DISK_NEUTRAL = {"load_format": (None, "auto", "safetensors"), "abort_all_requests": (False, True), "is_async": (False,),
                 "keep_pause": (False,), "manifest": (None,)}
_TENSOR_NEUTRAL = {"load_format": (None,), "abort_all_requests": (False, True), "selector": ("all", "target")}
_WAITING = 4  # updates that may wait while one is applied
_JSON_ROOM = 64 << 10  # bytes of a body besides the tensors' base64
_VERSION = re.compile(r"[0-9]{1,18}")  # ASCII digits: "²" is a digit to str.isdigit, not to int


class WeightRoutes:
    """The two routes over ``control`` (the supervisor, or None); ``native`` ends running
    generations for ``abort_all_requests``."""

    def __init__(self, control, native=None) -> None:
        self.control = control
        self.native = native
        self._applying = asyncio.Lock()
        self._waiting = 0

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/update_weights_from_disk", self.update_weights_from_disk),
                web.post("/update_weights_from_tensor", self.update_weights_from_tensor)]

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

        async def limit() -> int:
            return _JSON_ROOM

        return await self._update(request, {"model_path", *_DISK_IGNORED}, _DISK_NEUTRAL, tensors, limit)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's body with ``serialized_named_tensors`` holding the tensors by value
        (base64 safetensors; docs/router.md, "Weight updates from a trainer"); SGLang's
        pickled handles are refused with a 400 naming that form."""
        async def limit() -> int:
            layout, dtype = await self.control.weight_layout()
            return -(-max_entry_bytes(layout, SIZES[dtype]) // 3) * 4 + _JSON_ROOM

        async def tensors(body: dict) -> dict:
            layout, dtype = await self.control.weight_layout()
            from belayer_engine.weights.tensor import decode_named_tensors  # torch: only when asked

            return await asyncio.to_thread(decode_named_tensors, body.get(FIELD), layout, dtype)

        return await self._update(request, {FIELD, *_DISK_IGNORED}, _TENSOR_NEUTRAL, tensors, limit)

    async def _update(self, request: web.Request, fields: set[str], neutral: dict, tensors, limit) -> web.Response:
        if self.control is None:
            return answer(False, "this router has no engine-wide weight control: it serves fixed workers "
                          "(`belayer serve router`: update them directly) or a Ray engine "
                          "(RayEngine.update_weights)", 501)
        if self._waiting >= _WAITING:
            return answer(False, f"{self._waiting} weight updates already wait for the one being applied; "
                          "send the next once one is answered", 429)
        self._waiting += 1
        try:
            await self._applying.acquire()
        finally:
            self._waiting -= 1
        try:
            return await self._apply(request, fields, neutral, tensors, limit)
        except BodyTooLarge as exc:
            return answer(False, str(exc), 413)
        except BelayerError as exc:
            status = 409 if isinstance(exc, StaleWeightVersion) else failure_status(exc)
            return answer(False, f"{type(exc).__name__}: {exc}", status)
        finally:
            self._applying.release()

    async def _apply(self, request: web.Request, fields: set[str], neutral: dict, tensors, limit) -> web.Response:
        raw = await read_body(request, await limit())
        body = await asyncio.to_thread(parse_json_object, raw)
        del raw
        unknown = sorted(set(body) - {"weight_version", *fields, *neutral})
        if unknown:
            raise UsageError(f"unknown field(s) {unknown}")
        for key, ok in neutral.items():
            if key in body and body[key] not in ok:
                raise UsageError(f"{key}: not supported by this engine (only {ok!r} accepted)")
        version = parse_version(body.get("weight_version"))
        abort = body.get("abort_all_requests") is True
        state = await tensors(body)
        del body  # the base64 text: only the decoded tensors are kept while slots take them
        if abort and self.native is not None:  # AReaL sends it
            for run in list(self.native.running.values()):
                run.aborted.set()
        # shielded: a trainer that disconnects now must not cut an update that slots are taking
        applied = await asyncio.shield(self.control.update_weights(state, version=version))
        return answer(True, f"Succeeded to update model weights. Weight version updated to {applied}.", 200)


class BodyTooLarge(UsageError):
    """A body over the route's limit (HTTP 413)."""


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused (``BodyTooLarge``) as soon as it is known to exceed ``limit``:
    from its Content-Length before a byte is read, else while it streams in."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"body of {request.content_length} bytes; this route takes at most {limit} "
                           "(the served model's tensors in base64, and the JSON around them)")
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body over {limit} bytes, the most this route takes "
                               "(the served model's tensors in base64, and the JSON around them)")
        chunks.append(chunk)
    return b"".join(chunks)


def answer(success: bool, message: str, status: int) -> web.Response:
    """SGLang's answer to a weight update."""
    return web.json_response({"success": success, "message": message, "num_paused_requests": 0}, status=status)


def parse_version(value) -> int | None:
    """SGLang's ``weight_version`` is a string; the engine's versions are ints: a positive
    decimal of at most 18 ASCII digits (an int is taken too), else a 400 naming the field."""
    if value is None:
        return None
    text = str(value) if type(value) is int else value
    if not isinstance(text, str) or not _VERSION.fullmatch(text) or int(text) < 1:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise UsageError(f"weight_version: a positive integer of at most 18 digits (as a string), got {shown}")
    return int(text)
