"""Wire format of the arena's control socket: one JSON object per line.

A message may be followed by ``payload_nbytes`` raw bytes (tensor data of a weight
update). Errors travel as ``{"error": {"type": <belayer_core.errors class>, "message": ...}}``
and are raised again on the client side as that type.
"""

from __future__ import annotations

import json
import socket
from typing import BinaryIO

from belayer_core import errors

MAX_LINE = 1 << 26  # a describe() answer with CUDA IPC handles stays far below this


def send(sock: socket.socket, msg: dict, payload: bytes | memoryview = b"") -> None:
    if payload:
        msg = {**msg, "payload_nbytes": len(payload)}
    sock.sendall(json.dumps(msg).encode() + b"\n")
    if payload:
        sock.sendall(payload)


def recv(rfile: BinaryIO) -> dict | None:
    """The next message, or None at end of stream (the peer closed or died)."""
    line = rfile.readline(MAX_LINE)
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise errors.ArenaLost("control message truncated or too long")
    return json.loads(line)


def error_reply(exc: BaseException) -> dict:
    name = type(exc).__name__ if isinstance(exc, errors.BelayerError) else "UsageError"
    return {"error": {"type": name, "message": str(exc)}}


def raise_if_error(reply: dict) -> dict:
    if "error" in reply:
        err = reply["error"]
        cls = getattr(errors, str(err.get("type")), None)
        if not (isinstance(cls, type) and issubclass(cls, errors.BelayerError)):
            cls = errors.ArenaLost
        raise cls(err.get("message", "arena error"))
    return reply


def peer_uid(sock: socket.socket) -> int:
    """Uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    import struct

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def peer_pid(sock: socket.socket) -> int:
    import struct

    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]
