"""SGLang's weight-cache protocol, served by the arena: SGLang servers map its weights.

The arena (``arena.py``: ``--weight-cache-socket PATH``; this is one of its exports) keeps the model once more in SGLang's layout
(``layout.py``), in shared memory (CPU: POSIX shared memory through torch's
``file_system`` sharing strategy; GPU: CUDA IPC), and answers SGLang's own weight-cache
protocol on a Unix socket (mode 0600, same-uid peers only; ``srt/weight_cache/``):
4-byte big-endian length + pickle; ``{"type": "fetch_state", "config": ...}`` ->
``{"status": "ok", "entries": {name: {handle, shape, dtype, is_param}}, "pid": ...}``,
each handle a base64 ForkingPickler-reduced tensor. SGLang servers started with
``--weight-cache-mode client --weight-cache-socket`` build their model on the meta device
and map these tensors: a worker and its shadow hold no copy of the weights.

Servers that map the weights are registered (the arena's ``register_server`` op). A weight
update then never mixes versions within a step: every registered server is paused with
``mode=retract`` (running requests go back to its queue, their KV is dropped), the
tensors are overwritten in place, each server's cache is flushed and its
``weight_version`` set, then generation continues (retracted requests are recomputed on
the new weights). The arena's ``update_weights`` returns only after every live server
confirmed. SGLang's own watchdog kills a client whose owner pid is gone (every 5 s); the
supervisor's cold path sees the owner die first (the arena is its child).
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import socket
import socketserver
import struct
import threading
import urllib.error
import urllib.request
from pathlib import Path

import torch

from belayer_core.errors import UsageError, WorkerLost
from belayer_engine.arena import memory as mem
from belayer_engine.arena import protocol as proto
from belayer_engine.model.config import ModelConfig

from .layout import SGLangWeights
from .tp_layout import check_tp

MAX_REQUEST = 1 << 20  # a fetch_state request is a small dict


class _PlainUnpickler(pickle.Unpickler):
    """fetch_state requests are plain dicts: no class may be loaded from them."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf.extend(chunk)
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> object | None:
    header = _recv_exact(sock, 4)
    if header is None:
        return None
    (n,) = struct.unpack("!I", header)
    if n > MAX_REQUEST:
        raise UsageError(f"weight-cache request of {n} bytes refused")
    body = _recv_exact(sock, n)
    return None if body is None else _PlainUnpickler(io.BytesIO(body)).load()


def _send_frame(sock: socket.socket, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _gone(exc: OSError) -> bool:
    """True when the server's process is gone (nothing listens, or the connection dropped as
    it died); False for a server that is there but silent (a timeout)."""
    reason = getattr(exc, "reason", exc)  # urllib wraps the socket's error
    return isinstance(reason, ConnectionError)  # refused, reset, RemoteDisconnected; not a timeout


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return device if device.type != "cuda" else torch.device("cuda", (device.index or 0) + rank)


def _handle(t: torch.Tensor) -> str:
    """A tensor as SGLang's ``MultiprocessingSerializer`` writes it (base64 ForkingPickler)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(t)
    return base64.b64encode(buf.getvalue()).decode()


class WeightCacheExport:
    """SGLang-layout weights in shared memory, the socket that hands them out, and the
    registered servers that map them (an ``arena.exports.ArenaExport``)."""

    name = "weight_cache"
    holds_weights = True

    def __init__(self, model: ModelConfig, weights: dict[str, torch.Tensor], socket_path: str,
                 device: torch.device, http_timeout_s: float = 30.0, tp_size: int = 1):
        check_tp(model, tp_size)
        self.socket_path = socket_path
        self.device = device
        self.tp_size = tp_size
        self.http_timeout_s = http_timeout_s
        if device.type == "cpu":
            # file_system: a peer maps the storage by its shm name. The default (file
            # descriptor passing) only works between a parent and its children.
            torch.multiprocessing.set_sharing_strategy("file_system")
        # One shard per tensor-parallel rank, each on its rank's device (SGLang's rank r of a
        # server whose first GPU is cuda:b runs on cuda:b+r); every update writes all of them.
        self.ranks = [SGLangWeights(model, _rank_device(device, r), r, tp_size) for r in range(tp_size)]
        for shard in self.ranks:
            shard.write(weights)
            if device.type == "cpu":
                shard.flat.share_memory_()
                shard.rotary.share_memory_()
        self.weights = self.ranks[0]  # names, dtype and checks are every rank's
        self.entries = [{name: {"handle": _handle(t), "shape": list(t.shape),
                                "dtype": str(t.dtype).removeprefix("torch."), "is_param": shard.is_param(name)}
                         for name, t in shard.tensors.items()} for shard in self.ranks]
        self.nbytes = sum(t.numel() * t.element_size() for shard in self.ranks for t in (shard.flat, shard.rotary))
        self.version = 0
        self.lock = threading.Lock()  # one update or registration at a time
        self.servers: dict[str, dict] = {}  # url -> {"role", "pid"}
        self._auth: dict[str, str] = {}  # url -> Authorization header (the engine's worker secret)
        self.fetches = 0
        self._server: socketserver.ThreadingUnixStreamServer | None = None

    # ------------------------------------------------------------------ SGLang's socket
    def _serve_conn(self, sock: socket.socket) -> None:
        while (msg := _recv_frame(sock)) is not None:
            if not isinstance(msg, dict) or msg.get("type") != "fetch_state":
                _send_frame(sock, {"status": "error", "message": "only fetch_state is served"})
                continue
            config = msg.get("config") or {}
            rank = config.get("tp_rank", 0)
            if config.get("tp_size", 1) != self.tp_size or config.get("pp_size", 1) != 1 \
                    or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
                _send_frame(sock, {"status": "mismatch", "daemon_config": {"tp_size": self.tp_size, "pp_size": 1}})
                continue
            self.fetches += 1
            _send_frame(sock, {"status": "ok", "config": config, "entries": self.entries[rank],
                               "pid": os.getpid(), "transport_backend": "torch_ipc",
                               "preloaded_weights_bytes": 0})

    def start(self) -> None:
        export = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                if proto.peer_uid(self.request) not in (os.getuid(), 0):
                    return
                try:
                    export._serve_conn(self.request)
                except (OSError, ValueError, pickle.UnpicklingError, UsageError):
                    pass  # a broken peer ends only its own connection

        Path(self.socket_path).unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            self._server = socketserver.ThreadingUnixStreamServer(self.socket_path, Handler)
        finally:
            os.umask(old)
        self._server.daemon_threads = True
        os.chmod(self.socket_path, 0o600)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="sglang-weight-cache", daemon=True).start()

    def checksum(self) -> str:
        if self.tp_size == 1:
            return mem.checksum(self.weights.flat.view(-1).view(torch.uint8))
        return mem.checksum(torch.cat([s.flat.view(-1).view(torch.uint8).cpu() for s in self.ranks]))

    def check_weights(self, tensors) -> None:
        self.weights.check(tensors)

    def on_version(self, version: int) -> None:
        return None  # update_weights already synced every server to it

    def ops(self) -> dict:
        return {"register_server": self._register_op, "weight_cache": lambda _msg, _version: self.describe()}

    def _register_op(self, msg: dict, version: int) -> dict:
        """An SGLang server mapping the weights: synced to the arena's version now, paused and
        synced on every later update."""
        self.register(str(msg["url"]), str(msg.get("role", "worker")), int(msg.get("pid", 0)), version,
                      msg.get("authorization"))
        return {"version": version}

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        Path(self.socket_path).unlink(missing_ok=True)

    # ------------------------------------------------------------------ servers
    def describe(self) -> dict:
        with self.lock:
            servers = [{"url": u, **info} for u, info in self.servers.items()]  # never the header
        return {"socket": self.socket_path, "nbytes": self.nbytes, "fetches": self.fetches, "tp_size": self.tp_size,
                "version": self.version, "servers": servers}

    def _post(self, url: str, path: str, body: dict) -> int:
        headers = {"Content-Type": "application/json"}
        if self._auth.get(url):
            headers["Authorization"] = self._auth[url]
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.http_timeout_s) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def _sync(self, url: str, version: int) -> None:
        """Drop the server's cached KV and set its reported version (it is paused or idle)."""
        status = self._post(url, "/flush_cache", {})
        if status != 200:
            raise WorkerLost(f"{url}/flush_cache answered {status}")
        status = self._post(url, "/update_weight_version",
                            {"new_version": str(version), "abort_all_requests": False})
        if status != 200:
            raise WorkerLost(f"{url}/update_weight_version answered {status}")

    def register(self, url: str, role: str, pid: int, version: int, authorization: str | None = None) -> None:
        """A server that maps these weights; synced to ``version`` before it is recorded."""
        with self.lock:
            if authorization:
                self._auth[url] = str(authorization)
            try:
                self._sync(url, version)
            except OSError as exc:
                raise WorkerLost(f"{url} unreachable: {exc}") from exc
            self.servers[url] = {"role": role, "pid": pid}
            self.version = version

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Write HF-named ``tensors`` in place as ``version`` into every registered server."""
        self.weights.check(tensors)
        with self.lock:
            live, failed, unpaused = [], [], []
            for url in list(self.servers):
                try:
                    status = self._post(url, "/pause_generation", {"mode": "retract"})
                    if status == 200:
                        live.append(url)
                        continue
                    unpaused.append(f"{url} answered {status}")
                except OSError as exc:
                    if not _gone(exc):  # silent (a stopped rank holds its peers): it may serve again
                        unpaused.append(f"{url}: {exc}")
                self.servers.pop(url, None)  # never synced again: dead, or failed below
                self._auth.pop(url, None)
            try:
                # cast where the tensor is, copy straight into the rows: no device-side staging
                # copy (a 4B model's embedding cast on the GPU first left ~0.8 GB cached in the arena)
                cast = {k: v.to(dtype=self.weights.dtype).contiguous() for k, v in tensors.items()}
                for shard in self.ranks:  # every rank's shard, while every server is paused
                    shard.write(cast)
                    if shard.flat.device.type == "cuda":
                        torch.cuda.synchronize(shard.flat.device)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                self.version = version
                for url in live:
                    try:
                        self._sync(url, version)
                    except (OSError, WorkerLost) as exc:
                        failed.append(f"{url}: {exc}")
            finally:
                for url in live:
                    try:
                        self._post(url, "/continue_generation", {})
                    except OSError as exc:
                        failed.append(f"{url} (continue): {exc}")
            if unpaused:  # alive and unpaused: its cached KV is of the old weights, its version stale
                failed += [f"{u} (not paused: must be fenced)" for u in unpaused]
            if failed:
                raise WorkerLost(f"version {version} written but not confirmed by {failed}")
