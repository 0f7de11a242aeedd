"""Server-sent events as both ends of the engine read them: JSON ``data:`` lines up to ``[DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator

from belayer_core.errors import WorkerLost


async def sse_json(body: AsyncIterable[bytes], source: str) -> AsyncIterator[dict]:
    """Each ``data:`` payload of ``body`` as JSON, ending at ``data: [DONE]``.

    A body that ends before ``[DONE]`` was cut (the sender died): ``WorkerLost`` naming
    ``source``. Malformed JSON raises ``ValueError``.
    """
    async for raw in body:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)
    raise WorkerLost(f"{source} stream ended without [DONE]")
