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

from belayer.errors import BelayerError, UsageError

from .recovery import Continuation, Generation
from .text import TextStream

_FINISH = {"stop": "stop", "length": "length"}


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _sampling(body: dict) -> dict:
    params: dict = {}
    for key in ("temperature", "top_p", "top_k", "seed", "ignore_eos"):
        if body.get(key) is not None:
            params[key] = body[key]
    stop = body.get("stop")
    if stop:
        params["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if body.get("stop_token_ids"):
        params["stop_token_ids"] = list(body["stop_token_ids"])
    return params


def _max_tokens(body: dict, default: int) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens") or default
    if not isinstance(value, int) or value < 1:
        raise UsageError(f"max_tokens must be a positive integer, got {value!r}")
    return value


def _message_text(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(message.get("role"), str):
        raise UsageError("each message needs a string 'role'")
    return {"role": message["role"], "content": content or ""}


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

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise UsageError("'messages' must be a non-empty list")
            return self.codec.render_chat([_message_text(m) for m in messages])
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.codec.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise UsageError("'prompt' must be a string or a list of token ids (one prompt per request)")

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise UsageError("request body must be a JSON object")
            if (body.get("n") or 1) != 1:
                raise UsageError("only n=1 is supported")
            if body.get("logprobs") or body.get("top_logprobs"):
                raise UsageError("logprobs are not supported by this router")
            gen = Generation(
                prompt_ids=self._prompt_ids(body, chat),
                max_new_tokens=_max_tokens(body, self.default_max_tokens),
                sampling=_sampling(body),
            )
        except (UsageError, ValueError) as exc:
            return error_response(400, str(exc))
        text = TextStream(self.codec, gen.sampling.get("stop"))
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "created": int(time.time()), "model": body.get("model") or self.model_name}
        want_ids = bool(body.get("return_token_ids"))
        if body.get("stream"):
            return await self._stream(request, gen, text, chat, kind, meta, want_ids, body)
        try:
            async for chunk in self.continuation.run(gen):
                text.push(chunk.ids)
                if text.stopped:
                    gen.finish = {"type": "stop"}
                    break
        except UsageError as exc:
            return error_response(400, str(exc))
        except BelayerError as exc:
            return error_response(503, f"{type(exc).__name__}: {exc}", "server_error")
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

    async def _stream(self, request, gen, text, chat, kind, meta, want_ids, body) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = kind + ".chunk" if chat else kind
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

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
        try:
            pending, finish_ids = "", []
            async for chunk in self.continuation.run(gen):
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
            code = 400 if isinstance(exc, UsageError) else 503
            err = {"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "code": code}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        except ConnectionResetError:
            pass  # the client went away; Continuation's finally blocks close the upstream
        return resp


def _usage(gen: Generation) -> dict:
    n = len(gen.generated)
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": n, "total_tokens": len(gen.prompt_ids) + n}
