"""Talking to local processes over TCP: a free port to give a child, a health probe.

Below every part of the engine: the supervisor and each backend's launcher probe the
processes they start with ``http_status``; benchmarks pick ports with ``free_port``.
"""

from __future__ import annotations

import socket

import aiohttp

# An idle connection to a worker is dropped after this long, well before the worker closes
# it: SGLang's uvicorn closes one idle for 5 s (SGLANG_TIMEOUT_KEEP_ALIVE) and aiohttp keeps
# one 15 s by default, so a request sent on a connection the worker was closing met a reset
# ("Connection reset by peer") and failed as a broken stream of a healthy worker.
WORKER_KEEPALIVE_S = 2.0


def worker_connector(**kwargs) -> aiohttp.TCPConnector:
    """The connection pool for talking to workers (see ``WORKER_KEEPALIVE_S``)."""
    return aiohttp.TCPConnector(keepalive_timeout=WORKER_KEEPALIVE_S, **kwargs)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def http_status(session: aiohttp.ClientSession, url: str, timeout: float = 2.0) -> tuple[int, dict]:
    """Status and JSON object body of ``GET url`` (an empty dict for any other body)."""
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        try:
            body = await resp.json(content_type=None)
        except ValueError:
            body = {}
        return resp.status, body if isinstance(body, dict) else {}
