"""The per-engine secret that closes worker endpoints to all but the router and supervisor.

The engine draws a random secret at start and hands it to its workers and shadows in the
inherited environment variable ``BELAYER_WORKER_SECRET``, never on the command line
(``/proc/PID/cmdline`` is world-readable, ``/proc/PID/environ`` only to the same user).
Every request to a worker carries ``Authorization: Bearer <secret>``, the scheme of
SGLang's ``--api-key``, so the same header reaches a real SGLang server. Torch- and
aiohttp-free: the router, the supervisor and the worker all import it.
"""

from __future__ import annotations

import hmac
import os
import secrets

ENV = "BELAYER_WORKER_SECRET"


def new_secret() -> str:
    """256 random bits as hex. Not ``token_urlsafe``: one draw in 64 began with "-", and SGLang,
    handed it as ``--api-key`` through its ``--config`` file, took it for an option and exited
    ("argument --api-key: expected one argument"; seen in a CI rehearsal)."""
    return secrets.token_hex(32)


def headers(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def take_from_env() -> str | None:
    """The secret this process was started with, removed from the environment so that
    nothing it starts inherits it."""
    return os.environ.pop(ENV, None) or None


def authorized(authorization: str | None, secret: str | None) -> bool:
    """True when no secret is set, or the header carries it (constant-time compare)."""
    if not secret:
        return True
    return bearer_matches(authorization, secret)


def bearer_matches(authorization: str | None, key: str) -> bool:
    """``authorization`` is exactly ``Bearer <key>``, compared in constant time.

    aiohttp hands undecodable header bytes (``Bearer \\xff\\xfe``) over as surrogate
    escapes, which a plain ``.encode()`` refuses with a UnicodeEncodeError (a 500 with a
    traceback): they are encoded back to the bytes that were sent, which never match.
    """
    given = (authorization or "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {key}".encode())
