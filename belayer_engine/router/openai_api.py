"""OpenAI-compatible handlers: request parsing, response shaping, SSE streaming.

Only the shape lives here; the generation itself (and its recovery) is ``Continuation``.
Extensions: ``return_token_ids: true`` (request) adds ``token_ids`` to each choice or
chunk; every response carries a ``belayer`` object (recoveries, regenerated tokens).
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from belayer.errors import BelayerError, RequestFailed, UsageError

from .recovery import Continuation, Generation
from .requests import ChatRequest, CompletionRequest, message_dicts, parse_json, parse_request
from .text import TextStream

_FINISH = {"stop": "stop", "length": "length"}


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _failure(exc: BelayerError) -> tuple[int, str, str]:
    """(HTTP status, message, error type) of a request that could not be served."""
    if isinstance(exc, UsageError):
        return 400, str(exc), "invalid_request_error"
    if isinstance(exc, RequestFailed):  # this request alone; the engine is fine
        return 500, f"{type(exc).__name__}: {exc}", "server_error"
    return 503, f"{type(exc).__name__}: {exc}", "server_error"  # no healthy worker


class OpenAIHandlers:
    """The ``/v1`` endpoints over a ``Continuation``."""

    def __init__(self, continuation: Continuation, codec, model_name: str, default_max_tokens: int):
        self.continuation = continuation
        self.codec = codec
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "belayer"}]}
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    # ------------------------------------------------------------------ common path

    def _prompt_ids(self, req: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            return self.codec.render_chat(message_dicts(req))
        prompt = req.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = self.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise UsageError("prompt: the prompt is empty")
        return ids

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            req = parse_request(parse_json(await request.read()), chat)
            gen = Generation(
                prompt_ids=self._prompt_ids(req),
                max_new_tokens=req.budget(self.default_max_tokens),
                sampling=req.sampling(),
            )
        except UsageError as exc:
            return error_response(400, str(exc))
        text = TextStream(self.codec, gen.sampling.get("stop"))
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "created": int(time.time()), "model": req.model or self.model_name}
        want_ids = bool(req.return_token_ids)
        if req.stream:
            return await self._stream(request, gen, text, chat, kind, meta, want_ids, req)
        chunks = self.continuation.run(gen)
        try:
            async for chunk in chunks:
                text.push(chunk.ids)
                if text.stopped:
                    gen.finish = {"type": "stop"}
                    break
        except BelayerError as exc:
            return error_response(*_failure(exc))
        finally:
            await chunks.aclose()  # closes the worker stream now: a stop string ends the request there too
        content = text.emitted + text.push([], final=True)
        finish = _FINISH.get((gen.finish or {}).get("type"), "stop")
        choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        if want_ids:
            choice["token_ids"] = list(gen.generated)
        return web.json_response(
            {**meta, "object": kind, "choices": [choice], "usage": _usage(gen), "belayer": gen.summary()}
        )

    async def _stream(self, request, gen, text, chat, kind, meta, want_ids, req) -> web.StreamResponse:
        # The first chunk is awaited before the stream starts, so that a request the worker
        # refuses (prompt too long, ids out of range) or no worker can take still gets a
        # plain HTTP 4xx/503 with a JSON body rather than a 200 with an error event.
        chunks = self.continuation.run(gen)
        try:
            first_chunk = await anext(chunks, None)
        except BelayerError as exc:
            await chunks.aclose()
            return error_response(*_failure(exc))
        try:
            return await self._stream_from(request, first_chunk, chunks, gen, text, chat, kind, meta, want_ids, req)
        finally:
            await chunks.aclose()

    async def _stream_from(self, request, first_chunk, chunks, gen, text, chat, kind, meta, want_ids, req) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = kind + ".chunk" if chat else kind
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def send(delta_text: str, ids: list[int], finish: str | None) -> None:
            choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = {"content": delta_text} if delta_text or finish is None else {}
            else:
                choice["text"] = delta_text
            if want_ids:
                choice["token_ids"] = ids
            payload = {**meta, "object": obj, "choices": [choice]}
            if finish is not None:
                payload["belayer"] = gen.summary()
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        if chat:
            first = {**meta, "object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}]}
            await resp.write(b"data: " + json.dumps(first).encode() + b"\n\n")
        async def all_chunks():
            if first_chunk is not None:
                yield first_chunk
                async for chunk in chunks:
                    yield chunk

        try:
            pending, finish_ids = "", []
            async for chunk in all_chunks():
                delta = text.push(chunk.ids)
                if text.stopped:
                    gen.finish = {"type": "stop"}
                    pending = delta
                    break
                if chunk.finish:
                    pending, finish_ids = delta, chunk.ids
                    break
                if delta or (want_ids and chunk.ids):
                    await send(delta, chunk.ids, None)
            tail = pending + text.push([], final=True)
            await send(tail, finish_ids, _FINISH.get((gen.finish or {}).get("type"), "stop"))
            if include_usage:
                usage = {**meta, "object": obj, "choices": [], "usage": _usage(gen)}
                await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except BelayerError as exc:
            code, message, kind = _failure(exc)
            err = {"error": {"message": message, "type": kind, "code": code}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        except ConnectionResetError:
            pass  # the client went away; Continuation's finally blocks close the upstream
        return resp


def _usage(gen: Generation) -> dict:
    n = len(gen.generated)
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": n, "total_tokens": len(gen.prompt_ids) + n}
