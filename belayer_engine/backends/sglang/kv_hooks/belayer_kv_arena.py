"""The SGLang server's side of the arena's KV ops: a JSON-lines client and tensor mapping.

Runs in SGLang's interpreter (standard library and torch only). The arena's control
socket is 0600 and same-uid: its answers are trusted, so the tensor handles in them (torch's
ForkingPickler reductions: a shared-memory file on CPU, CUDA IPC on a GPU) are unpickled to
map the arena's memory into this process without a copy.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket

MAX_LINE = 1 << 26


class ArenaError(RuntimeError):
    """The arena refused a KV op or could not be reached."""


class NoWorkerYet(ArenaError):
    """A shadow attached before the worker it is to follow (they start side by side)."""


NO_WORKER = "a shadow needs a serving worker to follow"  # kv_pool.py's words


def call(op: str, **fields) -> dict:
    """One op on the arena named by ``BELAYER_KV_ARENA``; its answer, or ``ArenaError``."""
    path = os.environ["BELAYER_KV_ARENA"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(float(os.environ.get("BELAYER_KV_ARENA_TIMEOUT_S", "60")))
    try:
        sock.connect(path)
        sock.sendall(json.dumps({"op": op, **fields}).encode() + b"\n")
        line = sock.makefile("rb").readline(MAX_LINE)
    except OSError as exc:
        raise ArenaError(f"arena at {path} failed during {op}: {exc}") from exc
    finally:
        sock.close()
    if not line.endswith(b"\n"):
        raise ArenaError(f"arena at {path} closed the connection during {op}")
    reply = json.loads(line)
    if "error" in reply:
        if NO_WORKER in str(reply["error"].get("message")):
            raise NoWorkerYet(reply["error"]["message"])
        raise ArenaError(f"arena refused {op}: {reply['error'].get('type')}: {reply['error'].get('message')}")
    return reply


def tensor(handle: str):
    """The tensor an arena handle names, mapped into this process."""
    return pickle.loads(base64.b64decode(handle))
