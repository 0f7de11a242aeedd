"""Talking to local processes over TCP: a free port to give a child, a health probe.

Below every part of the engine: the supervisor and each backend's launcher probe the
processes they start with ``http_status``; benchmarks pick ports with ``free_port``.
"""

from __future__ import annotations

import random
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


# Ports handed to children come from outside the kernel's ephemeral range, and outside the
# ranges SGLang (22,000-29,999: its NCCL/TCPStore ports) and Ray (10,002-19,999: its workers)
# bind in: a port the kernel hands out for bind(0) or an outgoing connection can be taken by
# any process meanwhile (gloo's listeners among them), and an SGLang server binds its HTTP
# port ~30 s after it is chosen. Seen on the 2-core VM: "[Errno 98] error while attempting to
# bind on address" of a worker whose port a server starting beside it had taken.
CHILD_PORT_RANGES = ((20000, 21999), (61000, 65535))


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(v) for v in fh.read().split()[:2])
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def child_ports() -> list[int]:
    """The ports ``free_port`` draws from: ``CHILD_PORT_RANGES`` outside the ephemeral range."""
    low, high = _ephemeral_range()
    return [p for a, b in CHILD_PORT_RANGES for p in range(a, b + 1) if not low <= p <= high]


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A port free now on ``host`` for a child process to bind later: one the kernel never
    hands out by itself where there is one (``child_ports``), else one the kernel picks."""
    candidates = child_ports()
    for port in random.sample(candidates, min(attempts, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
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
