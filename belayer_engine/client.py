"""A small async client for a Belayer router (or any OpenAI-compatible server).

The ``openai`` SDK works unchanged; this helper exists for rollout code that wants the
generated token ids and the recovery record without an extra dependency.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

from belayer_core.errors import RequestFailed, UsageError, WorkerLost
from belayer_engine.common.sse import sse_json


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict = field(default_factory=dict)
    belayer: dict = field(default_factory=dict)


class EngineClient:
    """``async with EngineClient(engine.base_url) as c: r = await c.chat([...], max_tokens=32)``."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str = "belayer-default", timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout))

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._session.close()

    async def chat(self, messages: list[dict], **params) -> Completion:
        return await self._collect("/chat/completions", {"messages": messages, **params})

    async def complete(self, prompt: str | list[int], **params) -> Completion:
        return await self._collect("/completions", {"prompt": prompt, **params})

    async def stream_chat(self, messages: list[dict], **params) -> AsyncIterator[dict]:
        """Yield raw chunks (with ``token_ids``) of a streamed chat completion."""
        async for chunk in self._stream("/chat/completions", {"messages": messages, **params}):
            yield chunk

    async def stream_complete(self, prompt: str | list[int], **params) -> AsyncIterator[dict]:
        async for chunk in self._stream("/completions", {"prompt": prompt, **params}):
            yield chunk

    async def _collect(self, path: str, body: dict) -> Completion:
        body = {"model": self.model, "return_token_ids": True, **body}
        async with self._session.post(self.base_url + path, json=body) as resp:
            data = await resp.json(content_type=None)
            _raise_for(resp.status, data)
        choice = data["choices"][0]
        text = choice.get("text") if "text" in choice else choice["message"]["content"]
        return Completion(text, choice.get("token_ids", []), choice.get("finish_reason"), data.get("usage", {}), data.get("belayer", {}))

    async def _stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        body = {"model": self.model, "return_token_ids": True, "stream": True, **body}
        async with self._session.post(self.base_url + path, json=body) as resp:
            if resp.status != 200:
                _raise_for(resp.status, await resp.json(content_type=None))
            async for chunk in sse_json(resp.content, "router"):
                _raise_for(200, chunk)
                yield chunk


def _error_type(status: int) -> type[Exception]:
    """4xx: the request was bad; 500: it failed alone (the engine is fine); else no worker."""
    if 400 <= status < 500:
        return UsageError
    return RequestFailed if status == 500 else WorkerLost


def _raise_for(status: int, data: dict) -> None:
    if isinstance(data, dict) and "error" in data:
        message = data["error"].get("message", str(data["error"]))
        code = data["error"].get("code") if status == 200 else status  # an SSE error event carries its code
        raise _error_type(code if isinstance(code, int) else 503)(message)
    if status >= 400:
        raise _error_type(status)(f"HTTP {status}: {data}")
