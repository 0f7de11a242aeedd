"""OpenAI-compatible handlers: request parsing, response shaping, SSE streaming.

Only the shape lives here; the generation itself (and its recovery) is ``Continuation``.
``n`` choices are ``n`` independent generations (each recovers on its own), streamed as
chunks tagged by ``index``. Extensions: ``return_token_ids: true`` (request) adds
``token_ids`` to each choice or chunk and ``prompt_token_ids`` to the response (the first
chunk of a stream); every response carries a ``belayer`` object (recoveries, regenerated
tokens; for n > 1 the sums and each choice's record), and the final chunk of each streamed
choice carries that choice's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid

from aiohttp import web

from belayer_core.errors import BelayerError, Overloaded, RequestFailed, UsageError

from .logprobs import LogprobFormatter
from .recovery import Continuation, Generation
from .requests import (
    MAX_SEED,
    ChatRequest,
    CompletionRequest,
    message_dicts,
    parse_json,
    parse_request,
)
from .tasks import gather_all
from .text import TextStream

_FINISH = {"stop": "stop", "length": "length"}


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _failure(exc: BelayerError) -> tuple[int, str, str]:
    """(HTTP status, message, error type) of a request that could not be served."""
    if isinstance(exc, UsageError):
        return 400, str(exc), "invalid_request_error"
    if isinstance(exc, Overloaded):
        return 429, str(exc), "rate_limit_error"
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
        self.codec.check_ids(ids, "prompt")
        return ids

    def _choices(self, req: ChatRequest | CompletionRequest, chat: bool) -> list[_Choice]:
        prompt = self._prompt_ids(req)
        top = req.top_logprobs_num()
        out = []
        group = object()  # its choices are one request in the router's queue
        for index in range(req.choices()):
            sampling = req.sampling()
            if index and "sampling_seed" in sampling:
                sampling["sampling_seed"] = choice_seed(sampling["sampling_seed"], index)
            gen = Generation(prompt_ids=prompt, max_new_tokens=req.budget(self.default_max_tokens),
                             sampling=sampling, top_logprobs_num=top, group=group)
            out.append(_Choice(index, gen, TextStream(self.codec, sampling.get("stop")),
                               None if top is None else LogprobFormatter(self.codec, chat)))
        return out

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            req = parse_request(parse_json(await request.read()), chat)
            choices = self._choices(req, chat)
            self.continuation.admission.check_room(len(choices))
        except BelayerError as exc:
            return error_response(*_failure(exc))
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        meta = {"id": rid, "created": int(time.time()), "model": req.model or self.model_name}
        want_ids = bool(req.return_token_ids)
        if req.stream:
            return await self._stream(request, choices, chat, kind, meta, want_ids, req)
        try:
            await gather_all(self._collect(c) for c in choices)
        except BelayerError as exc:
            return error_response(*_failure(exc))
        out = []
        for c in choices:
            choice: dict = {"index": c.index, "finish_reason": c.finish_reason(), "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.content}
            else:
                choice["text"] = c.content
            if c.logprobs is not None:
                choice["logprobs"] = c.logprobs.part(c.gen.generated, c.gen.logprobs,
                                                     c.gen.top_logprobs if c.gen.top_logprobs_num else None)
            if want_ids:
                choice["token_ids"] = list(c.gen.generated)
            out.append(choice)
        body = {**meta, "object": kind, "choices": out, "usage": _usage(choices), "belayer": _summary(choices)}
        if want_ids:
            body["prompt_token_ids"] = list(choices[0].gen.prompt_ids)
        return web.json_response(body)

    async def _collect(self, c: _Choice) -> None:
        chunks = self.continuation.run(c.gen)
        try:
            async for chunk in chunks:
                c.text.push(chunk.ids)
                if c.text.stopped:
                    c.gen.finish = {"type": "stop"}
                    break
        finally:
            await chunks.aclose()  # closes the worker stream now: a stop string ends the request there too
        c.content = c.text.emitted + c.text.push([], final=True)

    async def _stream(self, request, choices, chat, kind, meta, want_ids, req) -> web.StreamResponse:
        # The first chunk of every choice is awaited before the stream starts, so that a
        # request the worker refuses (prompt too long, ids out of range) or no worker can take
        # still gets a plain HTTP 4xx/503 with a JSON body rather than a 200 with an error event.
        streams = [self.continuation.run(c.gen) for c in choices]
        try:
            try:
                firsts = await gather_all(anext(s, None) for s in streams)
            except BelayerError as exc:
                return error_response(*_failure(exc))
            return await self._stream_from(request, firsts, streams, choices, chat, kind, meta, want_ids, req)
        finally:
            for s in streams:
                await s.aclose()

    async def _stream_from(self, request, firsts, streams, choices, chat, kind, meta, want_ids, req) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = kind + ".chunk" if chat else kind
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        header = {"prompt_token_ids": list(choices[0].gen.prompt_ids)} if want_ids else {}

        async def write(payload: dict) -> None:
            nonlocal header
            payload = {**meta, "object": obj, **header, **payload}
            header = {}  # the prompt's ids go with the first chunk only
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(c, first, s, chat, want_ids, queue))
                 for c, first, s in zip(choices, firsts, streams, strict=True)]
        try:
            if chat:
                for c in choices:
                    await write({"choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None, "logprobs": None}]})
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is _END:
                    running -= 1
                elif isinstance(item, BelayerError):
                    code, message, err_kind = _failure(item)
                    err = {"error": {"message": message, "type": err_kind, "code": code}}
                    await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                    return resp
                else:
                    await write(item)
            if include_usage:
                await write({"choices": [], "usage": _usage(choices)})
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass  # the client went away; Continuation's finally blocks close the upstream
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return resp

    async def _pump(self, c: _Choice, first, chunks, chat: bool, want_ids: bool, queue: asyncio.Queue) -> None:
        """One choice's chunks, as payloads (minus the response fields) into ``queue``."""
        def payload(delta_text: str, ids: list[int], lps, top, finish: str | None) -> dict:
            choice: dict = {"index": c.index, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = {"content": delta_text} if delta_text or finish is None else {}
            else:
                choice["text"] = delta_text
            if c.logprobs is not None and ids:
                choice["logprobs"] = c.logprobs.part(ids, lps, top)
            if want_ids:
                choice["token_ids"] = ids
            out = {"choices": [choice]}
            if finish is not None:
                out["belayer"] = c.gen.summary()
            return out

        try:
            last = None
            if first is not None:
                chunk = first
                while chunk is not None:
                    delta = c.text.push(chunk.ids)
                    if c.text.stopped:
                        c.gen.finish = {"type": "stop"}
                    if c.text.stopped or chunk.finish:
                        last = (delta, chunk)
                        break
                    if delta or ((want_ids or c.logprobs is not None) and chunk.ids):
                        await queue.put(payload(delta, chunk.ids, chunk.logprobs, chunk.top, None))
                    chunk = await anext(chunks, None)
            tail = c.text.push([], final=True)
            if last is None:
                await queue.put(payload(tail, [], None, None, c.finish_reason()))
            else:
                delta, chunk = last
                await queue.put(payload(delta + tail, chunk.ids, chunk.logprobs, chunk.top, c.finish_reason()))
        except BelayerError as exc:
            await queue.put(exc)
        finally:
            await chunks.aclose()
            queue.put_nowait(_END)


_END = object()


class _Choice:
    """One of the ``n`` independent generations of a request, with its text and logprobs."""

    def __init__(self, index: int, gen: Generation, text: TextStream, logprobs: LogprobFormatter | None):
        self.index = index
        self.gen = gen
        self.text = text
        self.logprobs = logprobs
        self.content = ""

    def finish_reason(self) -> str:
        return _FINISH.get((self.gen.finish or {}).get("type"), "stop")


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: choice 0 keeps the request's seed (n=1 is unchanged); the
    others get distinct seeds derived from it, so the whole response is reproducible."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % MAX_SEED


def _usage(choices: list[_Choice]) -> dict:
    prompt = len(choices[0].gen.prompt_ids)  # one prompt, as OpenAI counts it for n > 1
    n = sum(len(c.gen.generated) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


def _summary(choices: list[_Choice]) -> dict:
    """The ``belayer`` record: one choice's own, or the sums over ``n`` plus each choice's."""
    if len(choices) == 1:
        return choices[0].gen.summary()
    per = [c.gen.summary() for c in choices]
    return {"recoveries": sum(s["recoveries"] for s in per),
            "regenerated_tokens": sum(s["regenerated_tokens"] for s in per),
            "reprefilled_tokens": sum(s["reprefilled_tokens"] for s in per),
            "replayed_tokens": sum(s["replayed_tokens"] for s in per),
            "adopted_tokens": sum(s["adopted_tokens"] for s in per),
            "diverged": any(s["diverged"] for s in per), "choices": per}
