"""The SGLang backend's arena: owns the weights and serves them to SGLang servers zero-copy.

One process per device. It holds the model once, in SGLang's layout (``layout.py``), in
shared memory (CPU: POSIX shared memory through torch's ``file_system`` sharing strategy;
GPU: CUDA IPC), and answers two Unix sockets (mode 0600, same-uid peers only):

- the **weight-cache socket**, in SGLang's own protocol (``srt/weight_cache/``: 4-byte
  big-endian length + pickle; ``{"type": "fetch_state", "config": ...}`` ->
  ``{"status": "ok", "entries": {name: {handle, shape, dtype, is_param}}, "pid": ...}``,
  each handle a base64 ForkingPickler-reduced tensor). SGLang servers started with
  ``--weight-cache-mode client --weight-cache-socket`` build their model on the meta
  device and map these tensors: a worker and its shadow hold no copy of their own.
- the **control socket**, in the arena's protocol (``arena_protocol``), so ``ArenaClient``
  works unchanged: ``describe``, ``health``, ``update_weights``, ``shutdown``, plus
  ``register`` / ``unregister`` of the SGLang servers that map the weights.

A weight update is versioned and never mixes versions within a step: every registered
server is paused with ``mode=retract`` (running requests go back to the queue, their KV is
dropped), the tensors are overwritten in place, each server's cache is flushed and its
``weight_version`` set, then generation continues (retracted requests are recomputed on
the new weights). ``update_weights`` returns only after every live server confirmed.
SGLang's own watchdog kills a client whose owner pid is gone (every 5 s); the supervisor's
cold path sees the owner die first (it is its child).

Run: ``python -m belayer_engine.backends.sglang.weight_server --socket S
--weight-cache-socket W [--model-dir DIR] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pickle
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from belayer.errors import BelayerError, UsageError, WorkerLost
from belayer_engine import arena_protocol as proto
from belayer_engine.model_config import ModelConfig
from belayer_engine.weights import load_safetensors_dir, torch_dtype

from .layout import SGLangWeights

MAX_MSG = 1 << 20  # a fetch_state request is a small dict


class WeightServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    socket: str
    weight_cache_socket: str
    model_dir: str
    device: str = "cpu"
    http_timeout_s: float = 30.0  # per call to an SGLang server during an update


class _PlainUnpickler(pickle.Unpickler):
    """fetch_state requests are plain dicts: no class may be loaded from them."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def _recv_frame(sock: socket.socket) -> object | None:
    header = _recv_exact(sock, 4)
    if header is None:
        return None
    (n,) = struct.unpack("!I", header)
    if n > MAX_MSG:
        raise UsageError(f"weight-cache request of {n} bytes refused")
    body = _recv_exact(sock, n)
    return None if body is None else _PlainUnpickler(io.BytesIO(body)).load()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf.extend(chunk)
    return bytes(buf)


def _send_frame(sock: socket.socket, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _handle(t: torch.Tensor) -> str:
    """A tensor as SGLang's ``MultiprocessingSerializer`` writes it (base64 ForkingPickler)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(t)
    return base64.b64encode(buf.getvalue()).decode()


class WeightServer:
    """Owns the SGLang-layout weights; serves them and updates them in place."""

    def __init__(self, cfg: WeightServerConfig):
        self.cfg = cfg
        self.started = time.time()
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu":
            # file_system: a peer maps the storage by its shm name. The default (file
            # descriptor passing) only works between a parent and its children.
            torch.multiprocessing.set_sharing_strategy("file_system")
        self.model = ModelConfig.from_dir(cfg.model_dir)
        t0 = time.perf_counter()
        self.weights = SGLangWeights(self.model, self.device)
        self.weights.write({k: v.to(torch_dtype(self.model.dtype))
                            for k, v in load_safetensors_dir(cfg.model_dir, self.model).items()})
        if self.device.type == "cpu":
            self.weights.flat.share_memory_()
        self.load_s = time.perf_counter() - t0
        self.entries = {name: {"handle": _handle(t), "shape": list(t.shape),
                               "dtype": str(t.dtype).removeprefix("torch."),
                               "is_param": self.weights.is_param(name)}
                        for name, t in self.weights.tensors.items()}
        self.nbytes = self.weights.flat.numel() * self.weights.flat.element_size()
        self.version = 0
        self.lock = threading.Lock()  # one update (or registration) at a time
        self.servers: dict[str, dict] = {}  # url -> {"role", "pid"}
        self.fetches = 0
        self._servers: list[socketserver.BaseServer] = []

    # ------------------------------------------------------------------ weight cache
    def handle_cache(self, sock: socket.socket) -> None:
        while (msg := _recv_frame(sock)) is not None:
            if not isinstance(msg, dict) or msg.get("type") != "fetch_state":
                _send_frame(sock, {"status": "error", "message": "unknown request"})
                continue
            config = msg.get("config") or {}
            if config.get("tp_size", 1) != 1 or config.get("pp_size", 1) != 1:
                _send_frame(sock, {"status": "mismatch", "daemon_config": {"tp_size": 1, "pp_size": 1}})
                continue
            self.fetches += 1
            _send_frame(sock, {"status": "ok", "config": config, "entries": self.entries,
                               "pid": os.getpid(), "transport_backend": "torch_ipc",
                               "preloaded_weights_bytes": 0})

    # ------------------------------------------------------------------ control
    def describe(self) -> dict:
        return {"arena_id": str(os.getpid()), "owner_pid": os.getpid(), "device": str(self.device),
                "backend": "sglang", "model": self.model.to_dict(), "model_dir": self.cfg.model_dir,
                "weight_cache_socket": self.cfg.weight_cache_socket, "weights_nbytes": self.nbytes,
                "load_s": self.load_s, "version": self.version}

    def health(self) -> dict:
        with self.lock:
            servers = [{"url": u, **info} for u, info in self.servers.items()]
        ok = Path(self.cfg.weight_cache_socket).exists()
        return {"status": "ok" if ok else "unhealthy", "owner_pid": os.getpid(),
                "device": str(self.device), "device_ok": ok,
                "device_detail": "ok" if ok else "weight-cache socket gone",
                "version": self.version, "uptime_s": time.time() - self.started,
                "fetches": self.fetches, "attached": servers}

    def _post(self, url: str, path: str, body: dict) -> int:
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.http_timeout_s) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def _sync_server(self, url: str) -> None:
        """Drop cached KV and report the current version (the server is paused or idle)."""
        status = self._post(url, "/flush_cache", {})
        if status != 200:
            raise WorkerLost(f"{url}/flush_cache answered {status}")
        self._post(url, "/update_weight_version",
                   {"new_version": str(self.version), "abort_all_requests": False})

    def register(self, url: str, role: str, pid: int) -> dict:
        """A server that maps these weights; it is synced to the current version now."""
        with self.lock:
            self._sync_server(url)
            self.servers[url] = {"role": role, "pid": pid}
            return {"version": self.version}

    def unregister(self, url: str) -> dict:
        with self.lock:
            self.servers.pop(url, None)
        return {"ok": True}

    def update_weights(self, tensors: dict[str, torch.Tensor]) -> int:
        self.weights.check(tensors)
        with self.lock:
            live, gone = [], []
            for url in list(self.servers):
                try:
                    if self._post(url, "/pause_generation", {"mode": "retract"}) == 200:
                        live.append(url)
                        continue
                except OSError:
                    pass
                gone.append(url)  # dead or dying: the supervisor replaces it
            try:
                self.weights.write({k: v.to(self.weights.dtype) for k, v in tensors.items()})
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.version += 1
                failed = []
                for url in live:
                    try:
                        self._sync_server(url)
                    except (OSError, BelayerError) as exc:
                        failed.append(f"{url}: {exc}")
            finally:
                for url in live:
                    try:
                        self._post(url, "/continue_generation", {})
                    except OSError:
                        pass
            for url in gone:
                self.servers.pop(url, None)
            if failed:
                raise WorkerLost(f"version {self.version} written but not confirmed by {failed}")
            return self.version

    def handle_control(self, sock: socket.socket) -> None:
        rfile = sock.makefile("rb")
        while (msg := proto.recv(rfile)) is not None:
            op = msg.get("op")
            try:
                if op == "describe":
                    reply = self.describe()
                elif op == "health":
                    reply = self.health()
                elif op == "update_weights":
                    reply = {"version": self.update_weights(_read_tensors(msg, rfile))}
                elif op == "register":
                    reply = self.register(str(msg["url"]), str(msg.get("role", "worker")), int(msg.get("pid", 0)))
                elif op == "unregister":
                    reply = self.unregister(str(msg["url"]))
                elif op == "shutdown":
                    threading.Thread(target=self.stop, daemon=True).start()
                    reply = {"status": "stopping"}
                else:
                    raise UsageError(f"unknown op {op!r}")
            except BelayerError as exc:
                reply = proto.error_reply(exc)
            except (KeyError, TypeError, ValueError, RuntimeError, OSError) as exc:
                reply = proto.error_reply(UsageError(f"{op}: {type(exc).__name__}: {exc}"))
            proto.send(sock, reply)
            if op == "update_weights" and "error" in reply:
                return  # the payload may be half read

    # ------------------------------------------------------------------ lifecycle
    def serve_forever(self) -> None:
        threads = []
        for path, fn in ((self.cfg.weight_cache_socket, self.handle_cache), (self.cfg.socket, self.handle_control)):
            server = _unix_server(path, fn)
            self._servers.append(server)
            threads.append(threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True))
        for t in threads:
            t.start()
        print(json.dumps({"event": "ready", "socket": self.cfg.socket, "pid": os.getpid(),
                          "weight_cache_socket": self.cfg.weight_cache_socket,
                          "weights_nbytes": self.nbytes, "load_s": round(self.load_s, 3)}), flush=True)
        try:
            for t in threads:
                t.join()
        finally:
            self.cleanup()

    def stop(self) -> None:
        for s in self._servers:
            s.shutdown()

    def cleanup(self) -> None:
        for path in (self.cfg.socket, self.cfg.weight_cache_socket):
            Path(path).unlink(missing_ok=True)


def _read_tensors(msg: dict, rfile) -> dict[str, torch.Tensor]:
    specs = msg.get("tensors")
    if not isinstance(specs, list):
        raise UsageError("update_weights needs 'tensors' (a list); CUDA IPC updates are not supported here yet")
    if sum(int(s["nbytes"]) for s in specs) != msg.get("payload_nbytes", 0):
        raise UsageError("update_weights payload size does not match its tensors")
    out = {}
    for s in specs:
        data = bytearray(rfile.read(int(s["nbytes"])))
        out[s["name"]] = torch.frombuffer(data, dtype=torch_dtype(s["dtype"])).view(s["shape"])
    return out


def _unix_server(path: str, fn) -> socketserver.ThreadingUnixStreamServer:
    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            if proto.peer_uid(self.request) not in (os.getuid(), 0):
                return
            try:
                fn(self.request)
            except (OSError, ValueError, pickle.UnpicklingError, BelayerError):
                pass  # a broken peer ends only its own connection

    Path(path).unlink(missing_ok=True)
    old = os.umask(0o177)
    try:
        server = socketserver.ThreadingUnixStreamServer(path, Handler)
    finally:
        os.umask(old)
    server.daemon_threads = True
    os.chmod(path, 0o600)
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m belayer_engine.backends.sglang.weight_server",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", required=True, help="control socket (arena protocol)")
    p.add_argument("--weight-cache-socket", required=True, help="SGLang weight-cache socket")
    p.add_argument("--model-dir", default=None, help="HF-layout dir; default: the embedded model")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    model_dir = args.model_dir
    if model_dir is None:
        from .model_dir import ensure_embedded_model

        model_dir = str(ensure_embedded_model())
    torch.set_num_threads(1)
    server = WeightServer(WeightServerConfig(socket=args.socket, weight_cache_socket=args.weight_cache_socket,
                                             model_dir=model_dir, device=args.device))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.stop).start())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
