"""The engine's weight endpoint: how a learner in another process updates the engine.

HTTP on a Unix socket in the engine's run dir (mode 0600, same-uid peers only, checked
with ``SO_PEERCRED`` too): ``POST /v1/weights[?version=N]`` with a safetensors body
(``weights_wire``; all weights or some) goes through ``Supervisor.update_weights``, the
path of ``RecoverableEngine.update_weights``: one engine-wide version on every slot, a kept
host copy, re-applied to a slot whose arena is cold-restarted. ``GET /v1/weights`` answers
the current version. A push straight to one arena (``ArenaClient``) has none of this.

Answers: 200 ``{"version", "names"}``; 400 bad body (unknown name, wrong shape or dtype,
malformed header, short body); 409 a ``version`` not newer than the current one; 503 no
slot could take it (infrastructure). Errors are ``{"error": {"type", "message"}}`` with a
``belayer_core.errors`` class, raised again as that class by ``weights_client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
from pathlib import Path

from aiohttp import web

from belayer_core.errors import BelayerError, InfraError, StaleWeightVersion, UsageError
from belayer_engine.arena import protocol as proto
from belayer_engine.weights import wire as weights_wire
from belayer_engine.weights.sync import WeightSync
from belayer_engine.weights.wire import ROUTE

_READ_CHUNK = 1 << 20


def bind_private(path: Path) -> socket.socket:
    """A listening Unix socket at ``path`` that is 0600 from the moment it is reachable:
    bound in a fresh 0700 directory, chmod-ed, then renamed into place (no umask change,
    which would race with the engine's other threads)."""
    path.unlink(missing_ok=True)
    private = Path(tempfile.mkdtemp(prefix=".weights-", dir=path.parent))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(private / "s"))
        os.chmod(private / "s", 0o600)
        os.rename(private / "s", path)
        sock.listen(16)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            (private / "s").unlink()
        private.rmdir()
    return sock


def _status(exc: BelayerError) -> int:
    if isinstance(exc, StaleWeightVersion):
        return 409
    if isinstance(exc, UsageError):
        return 400
    return 503 if isinstance(exc, InfraError) else 500


class WeightsEndpoint:
    """Serves ``ROUTE`` on ``path`` for the engine's ``WeightSync`` (on the engine's loop)."""

    def __init__(self, sync: WeightSync, path: Path) -> None:
        self.sync = sync
        self.path = path
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(middlewares=[self._same_user])
        app.router.add_post(ROUTE, self._post)
        app.router.add_get(ROUTE, self._get)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, bind_private(self.path)).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self.path.unlink(missing_ok=True)

    @web.middleware
    async def _same_user(self, request: web.Request, handler):
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is None or proto.peer_uid(sock) not in (os.getuid(), 0):
            return _error(403, UsageError("the weight endpoint answers its own user only"))
        try:
            return await handler(request)
        except BelayerError as exc:
            return _error(_status(exc), exc)

    async def _get(self, request: web.Request) -> web.Response:
        weights = self.sync.weights
        return web.json_response({"version": weights.version, "names": len(weights.snapshot()[0]),
                                  "kept_nbytes": weights.nbytes})

    async def _post(self, request: web.Request) -> web.Response:
        version = _version(request.query)
        layout, dtype = await self.sync.weight_layout()
        body = request.content
        try:
            specs = weights_wire.parse_header(
                await body.readexactly(weights_wire.header_length(await body.readexactly(8))), layout, dtype)
            tensors = {s.name: await _read_tensor(body, s) for s in specs}
        except EOFError:  # asyncio.IncompleteReadError
            raise UsageError("weights body too short: it ended before its header and tensors did") from None
        if await body.read(1):
            raise UsageError("weights body has bytes after its last tensor")
        # shielded: a learner that disconnects now must not cut an update that slots are taking
        applied = await asyncio.shield(self.sync.update_weights(tensors, version=version))
        return web.json_response({"version": applied, "names": len(tensors)})


async def _read_tensor(body, spec: weights_wire.Spec):
    import torch

    from belayer_engine.model.weights import torch_dtype

    buf, at = bytearray(spec.end - spec.begin), 0
    while at < len(buf):
        chunk = await body.read(min(_READ_CHUNK, len(buf) - at))
        if not chunk:
            raise EOFError
        buf[at:at + len(chunk)] = chunk
        at += len(chunk)
    if not buf:
        return torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
    return torch.frombuffer(buf, dtype=torch_dtype(spec.dtype)).view(spec.shape)


def _version(query) -> int | None:
    extra = sorted(set(query) - {"version"})
    if extra:
        raise UsageError(f"unknown query parameter(s) {extra}; only 'version' is accepted")
    if "version" not in query:
        return None
    try:
        version = int(query["version"])
    except ValueError:
        raise UsageError(f"version must be an int, got {query['version']!r}") from None
    if version < 1:
        raise UsageError(f"version must be >= 1, got {version}")
    return version


def _error(status: int, exc: BelayerError) -> web.Response:
    return web.json_response({"error": {"type": type(exc).__name__, "message": str(exc)}}, status=status)
