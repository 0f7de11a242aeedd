"""Client of the engine's weight endpoint (``weights_endpoint``), for a learner in another process.

``EngineWeights(engine.weights_socket).update_weights(state_dict)`` is
``RecoverableEngine.update_weights`` from another process: every slot, one engine-wide
version, kept for slots that are cold-restarted. Stdlib HTTP over the Unix socket; the body
is streamed tensor by tensor (``weights_wire``). Errors come back as ``belayer_core.errors`` types.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Mapping

from belayer_core import errors
from belayer_engine.weights import wire as weights_wire
from belayer_engine.weights.wire import ROUTE


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None):
        super().__init__("engine", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class EngineWeights:
    """One short connection per call. ``timeout``: per socket operation (an update returns
    once every slot serves it, which may include the slots' workers switching)."""

    def __init__(self, socket_path: str, timeout: float = 300.0):
        self.path = str(socket_path)
        self.timeout = timeout

    def version(self) -> int:
        """The engine-wide version of the weights the engine keeps (0: none pushed yet)."""
        return int(self._request("GET", ROUTE)["version"])

    def update_weights(self, state_dict: Mapping, version: int | None = None) -> int:
        """Push new weights (all or some, by HF name; any device, the served dtype) to every
        slot; returns the engine-wide version once every slot in service serves it.
        ``version``: publish this number (newer than the current one) instead of current + 1."""
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise errors.UsageError("update_weights needs a non-empty mapping: HF weight name -> tensor")
        length, pieces = weights_wire.encode(state_dict)
        target = ROUTE if version is None else f"{ROUTE}?version={int(version)}"
        return int(self._request("POST", target, length, pieces)["version"])

    def _request(self, method: str, target: str, length: int = 0, pieces=()) -> dict:
        conn = _UnixConnection(self.path, self.timeout)
        try:
            try:
                conn.putrequest(method, target, skip_accept_encoding=True)
                conn.putheader("Content-Type", "application/octet-stream")
                conn.putheader("Content-Length", str(length))
                conn.endheaders()
                sent_error: OSError | None = None
                for piece in pieces:
                    try:
                        conn.send(piece)
                    except OSError as exc:  # refused early (bad header): its answer is still readable
                        sent_error = exc
                        break
                try:
                    resp = conn.getresponse()
                    status, raw = resp.status, resp.read()
                except (OSError, http.client.HTTPException):
                    if sent_error is not None:
                        raise sent_error from None
                    raise
            except (OSError, http.client.HTTPException) as exc:
                raise errors.ArenaLost(f"engine weight endpoint at {self.path}: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()
        return _answer(status, raw)


def _answer(status: int, raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    if status == 200 and isinstance(body, dict) and "error" not in body:
        return body
    err = body.get("error", {}) if isinstance(body, dict) else {}
    cls = getattr(errors, str(err.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.BelayerError)):
        cls = errors.UsageError if 400 <= status < 500 else errors.ArenaLost
    raise cls(f"{err.get('message') or raw[:300].decode(errors='replace')} (HTTP {status})")
