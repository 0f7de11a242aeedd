"""Arena server: one process per device that owns the weights and the KV arena.

Workers come and go (crash, SIGKILL, handover); the memory stays here. A Unix socket
(mode 0600, same-uid peers only) carries JSON-line requests: ``describe``, ``health``,
``checksums``, ``update_weights``, ``shutdown`` and a persistent ``attach`` per worker.

Weight versions are double-buffered: a new version is written into the slot nobody
serves, published (version + 1), pushed to every attached worker, and ``update_weights``
returns only when each live worker has confirmed it switched. The slot being overwritten
is always one no worker uses (the update first waits until all of them confirmed the
current version), so no copy happens in workers and no stale version is served after
``update_weights`` returns. Only one attached worker holds the live-KV lease at a time;
the lease is freed when its connection closes, i.e. when that process is gone.

Run: ``python -m belayer_engine.arena --socket PATH [--device cpu|cuda:N] [model options]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from belayer_core.errors import ArenaLost, BelayerError, UsageError, WorkerLost
from belayer_engine import owner
from belayer_engine.arena import memory as mem
from belayer_engine.arena import protocol as proto
from belayer_engine.arena.config import FLAGS, ArenaConfig, add_flags
from belayer_engine.arena.cuda_limits import set_thread_stack
from belayer_engine.arena.device_check import check_device
from belayer_engine.arena.payload import read_update
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import init_weights, load_safetensors_dir, torch_dtype


@dataclass
class _Attached:
    conn_id: int
    role: str
    worker_id: str
    pid: int
    version: int
    sock: socket.socket
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    waiting_kv: bool = False  # inside acquire_kv, waiting for the lease (health reports it)

    def push(self, msg: dict) -> None:
        try:
            with self.send_lock:
                proto.send(self.sock, msg)
        except OSError:
            pass  # the reader thread sees the closed connection and drops it


class ArenaServer:
    """Allocates the regions, answers the control socket, runs weight-version updates."""

    def __init__(self, cfg: ArenaConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.started = time.time()
        mem.reap_orphans()  # shm files of arenas that were SIGKILLed
        if cfg.model_dir:
            self.model = ModelConfig.from_dir(cfg.model_dir)
            weights = load_safetensors_dir(cfg.model_dir, self.model)
        else:
            self.model = ModelConfig() if cfg.preset == "small" else ModelConfig.qwen3_4b()
            weights = init_weights(self.model, cfg.seed, self.device)
        self.dtype = torch_dtype(self.model.dtype)
        self.layout, slot_nbytes = mem.weight_layout(self.model)  # HF names and shapes, in every mode
        self.regions: dict[str, torch.Tensor] = {}
        self.handles: dict[str, dict] = {}
        self.slots: list[dict[str, torch.Tensor]] = []  # none in an SGLang-only arena
        if cfg.reference_slots:
            total_blocks = cfg.num_blocks + cfg.scratch_blocks  # scratch blocks sit at the end
            sizes = {"w0": slot_nbytes, "w1": slot_nbytes,
                     "kv": mem.kv_nbytes(self.model, total_blocks, cfg.block_size)}
            for name, nbytes in sizes.items():
                self.regions[name], self.handles[name] = mem.allocate(name, nbytes, self.device)
            self.slots = [mem.weight_views(self.regions[s], self.layout, self.dtype) for s in ("w0", "w1")]
            for name, t in weights.items():
                self.slots[0][name].copy_(t)
            self.regions["w1"].copy_(self.regions["w0"])
        self.export = None  # SGLang servers map the weights through it (backends/sglang)
        if cfg.weight_cache_socket:
            from belayer_engine.backends.sglang.weight_cache import WeightCacheExport

            self.export = WeightCacheExport(self.model, weights, cfg.weight_cache_socket, self.device)
            self.export.start()
        del weights
        if self.device.type == "cuda":  # the loaded HF tensors' blocks go back to the device
            torch.cuda.empty_cache()
        self.cuda_stack = set_thread_stack(self.device, cfg.cuda_stack_bytes)  # (before, after) bytes; None on CPU
        ok, detail = check_device(self.device, self.handles)  # loads its kernels before any handover
        if not ok:
            raise ArenaLost(f"arena on {self.device}: the device check failed at start: {detail}")
        self.version, self.slot = 0, 0
        self.cond = threading.Condition()
        self.update_lock = threading.Lock()
        self.attached: dict[int, _Attached] = {}
        self.kv_holder: int | None = None
        self._ids = itertools.count(1)
        self.server: socketserver.ThreadingUnixStreamServer | None = None

    # ------------------------------------------------------------------ answers
    def describe(self) -> dict:
        return {"arena_id": f"{os.getpid()}", "owner_pid": os.getpid(), "device": str(self.device),
                "model": self.model.to_dict(), "layout": self.layout, "regions": self.handles,
                "kv": {"num_blocks": self.cfg.num_blocks, "block_size": self.cfg.block_size,
                       "scratch_blocks": self.cfg.scratch_blocks},
                "version": self.version, "slot": self.slot, "cuda_stack": self.cuda_stack,
                "weight_cache": self.export.describe() if self.export else None}

    def health(self) -> dict:
        device_ok, detail = check_device(self.device, self.handles)
        with self.cond:
            attached = [{"role": a.role, "worker_id": a.worker_id, "pid": a.pid,
                         "version": a.version, "kv_lease": a.conn_id == self.kv_holder,
                         "kv_waiting": a.waiting_kv}
                        for a in self.attached.values()]
        return {"status": "ok" if device_ok else "unhealthy", "owner_pid": os.getpid(),
                "device": str(self.device), "device_ok": device_ok, "device_detail": detail,
                "version": self.version, "uptime_s": time.time() - self.started,
                "attached": attached,
                "weight_cache": self.export.describe() if self.export else None}

    def checksums(self) -> dict:
        """sha256 of each weight slot, of the live KV blocks and of the scratch blocks (and of
        the SGLang-layout weights when they are served)."""
        out = {"weight_cache": mem.checksum(self.export.weights.flat.view(-1).view(torch.uint8))} if self.export else {}
        if not self.slots:
            return out
        out.update({name: mem.checksum(self.regions[name]) for name in ("w0", "w1")})
        kv = mem.kv_view(self.regions["kv"], self.model, self.cfg.num_blocks +
                         self.cfg.scratch_blocks, self.cfg.block_size)
        out["kv"] = mem.checksum(kv[:, :, : self.cfg.num_blocks].contiguous().view(-1))
        out["scratch"] = mem.checksum(kv[:, :, self.cfg.num_blocks :].contiguous().view(-1))
        return out

    # ------------------------------------------------------------------ weight updates
    def _all_on(self, version: int) -> bool:
        return all(a.version >= version for a in self.attached.values())

    def _laggards(self, version: int) -> list[str]:
        return [f"{a.worker_id}(pid {a.pid}, v{a.version})" for a in self.attached.values()
                if a.version < version]

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Write a new version into the free slot, publish it, wait for every worker.

        ``version``: the number to publish (default: current + 1). An engine spread over
        several arenas (``belayer_engine.ray``) gives a fresh arena its engine-wide version
        in one update, so every slot reports the same number for the same weights.
        """
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise UsageError(f"version must be an int, got {version!r}")
        if not self.slots:
            return self._update_weight_cache_only(tensors, version)
        for name, t in tensors.items():
            if name not in self.layout:
                raise UsageError(f"unknown weight {name!r}")
            if list(t.shape) != self.layout[name][1]:
                raise UsageError(f"{name}: shape {list(t.shape)} != {self.layout[name][1]}")
        with self.update_lock:
            with self.cond:
                if not self.cond.wait_for(lambda: self._all_on(self.version),
                                          self.cfg.ack_timeout_s):
                    raise WorkerLost(f"workers still serve an older version: "
                                     f"{self._laggards(self.version)}")
                if version is not None and version <= self.version:
                    raise UsageError(f"version {version} is not newer than the current {self.version}")
                staging = 1 - self.slot
            names = ("w0", "w1")
            self.regions[names[staging]].copy_(self.regions[names[self.slot]])
            for name, t in tensors.items():
                self.slots[staging][name].copy_(t)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            with self.cond:
                self.version = self.version + 1 if version is None else version
                self.slot = staging
                version = self.version
                for a in list(self.attached.values()):
                    a.push({"event": "version", "version": version, "slot": staging})
                if not self.cond.wait_for(lambda: self._all_on(version), self.cfg.ack_timeout_s):
                    raise WorkerLost(f"version {version} published but not confirmed by "
                                     f"{self._laggards(version)}")
            if self.export is not None:  # in place, servers paused meanwhile
                self.export.update(tensors, version)
        return version

    def _update_weight_cache_only(self, tensors: dict[str, torch.Tensor], version: int | None) -> int:
        """No reference slots: the SGLang-layout weights are the only copy; written in place
        while every registered server is paused (``WeightCacheExport.update``)."""
        assert self.export is not None
        self.export.weights.check(tensors)
        with self.update_lock:
            with self.cond:
                if version is not None and version <= self.version:
                    raise UsageError(f"version {version} is not newer than the current {self.version}")
                self.version = self.version + 1 if version is None else version
                version = self.version
            self.export.update(tensors, version)
        return version

    def register_server(self, msg: dict) -> dict:
        """An SGLang server mapping the weight cache: synced to the current version now,
        paused and synced on every later update."""
        if self.export is None:
            raise UsageError("this arena serves no weight cache (start it with --weight-cache-socket)")
        with self.update_lock:
            self.export.register(str(msg["url"]), str(msg.get("role", "worker")), int(msg.get("pid", 0)),
                                 self.version, msg.get("authorization"))
            return {"version": self.version}

    # ------------------------------------------------------------------ connections
    def handle(self, sock: socket.socket) -> None:
        if proto.peer_uid(sock) not in (os.getuid(), 0):
            return
        rfile = sock.makefile("rb")
        while True:
            msg = proto.recv(rfile)
            if msg is None:
                return
            op = msg.get("op")
            try:
                if op == "attach":
                    self._attached_loop(sock, rfile, msg)
                    return
                if op == "describe":
                    reply = self.describe()
                elif op == "health":
                    reply = self.health()
                elif op == "checksums":
                    reply = self.checksums()
                elif op == "update_weights":
                    reply = {"version": self.update_weights(read_update(msg, rfile), msg.get("version"))}
                elif op == "register_server":
                    reply = self.register_server(msg)
                elif op == "weight_cache":
                    if self.export is None:
                        raise UsageError("this arena serves no weight cache (start it with --weight-cache-socket)")
                    reply = self.export.describe()
                elif op == "shutdown":
                    reply = {"status": "stopping"}  # sent first; the stop starts after the send below
                else:
                    raise UsageError(f"unknown op {op!r}")
            except BelayerError as exc:
                reply = proto.error_reply(exc)
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                reply = proto.error_reply(UsageError(f"{op}: {type(exc).__name__}: {exc}"))
            proto.send(sock, reply)  # every control op is answered before the arena acts on it
            if op == "shutdown":
                threading.Thread(target=self.stop, daemon=True).start()
                return
            if op == "update_weights" and "error" in reply:
                return  # the payload may be half read: end this connection

    def _acquire_lease(self, conn: _Attached) -> None:
        with self.cond:
            conn.waiting_kv = True
            try:
                free = self.cond.wait_for(lambda: self.kv_holder in (None, conn.conn_id),
                                          self.cfg.lease_wait_s)
            finally:
                conn.waiting_kv = False
            if not free:
                holder = self.attached.get(self.kv_holder)
                who = f"{holder.worker_id} (pid {holder.pid})" if holder else "?"
                raise UsageError(f"live KV is held by {who}; fence it before activating another")
            self.kv_holder = conn.conn_id
            conn.role = "active"

    def _attached_loop(self, sock: socket.socket, rfile, msg: dict) -> None:
        role = msg.get("role", "active")
        if role not in ("active", "shadow"):
            raise UsageError("attach role must be 'active' or 'shadow'")
        if not self.slots:
            raise UsageError("this arena holds no reference-worker slots (started with --no-reference-slots): "
                             "only SGLang weight-cache clients map its weights")
        with self.cond:
            conn = _Attached(next(self._ids), role, str(msg.get("worker_id", "?")),
                             proto.peer_pid(sock), self.version, sock)
            self.attached[conn.conn_id] = conn
            reply = {"reply": "attach", **self.describe()}
        try:
            try:
                if role == "active":
                    self._acquire_lease(conn)
            except BelayerError as exc:
                conn.push({"reply": "attach", **proto.error_reply(exc)})
                return
            conn.push(reply)
            while (m := proto.recv(rfile)) is not None:
                op = m.get("op")
                if op == "using":
                    with self.cond:
                        conn.version = int(m["version"])
                        self.cond.notify_all()
                elif op == "acquire_kv":
                    try:
                        self._acquire_lease(conn)
                        conn.push({"reply": "acquire_kv", "ok": True})
                    except BelayerError as exc:
                        conn.push({"reply": "acquire_kv", **proto.error_reply(exc)})
                elif op == "ping":
                    conn.push({"reply": "ping", "version": self.version})
        finally:
            with self.cond:
                self.attached.pop(conn.conn_id, None)
                if self.kv_holder == conn.conn_id:
                    self.kv_holder = None
                self.cond.notify_all()

    # ------------------------------------------------------------------ lifecycle
    def serve_forever(self) -> None:
        arena = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                arena.handle(self.request)

        path = Path(self.cfg.socket)
        path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            self.server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        finally:
            os.umask(old)
        self.server.daemon_threads = True
        os.chmod(path, 0o600)
        print(f'{{"event": "ready", "socket": "{path}", "pid": {os.getpid()}}}', flush=True)
        try:
            self.server.serve_forever(poll_interval=0.2)
        finally:
            self.cleanup()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()

    def cleanup(self) -> None:
        Path(self.cfg.socket).unlink(missing_ok=True)
        if self.export is not None:
            self.export.close()
        for h in self.handles.values():
            if h["kind"] == "shm":
                Path(h["path"]).unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    cfg = FLAGS.build(args)
    torch.set_num_threads(1)
    server: ArenaServer | None = None

    def die(*_) -> None:
        """SIGTERM (a clean engine stop) or the owner's death: remove the shm files, exit."""
        if server is not None:
            server.cleanup()
        os._exit(0)

    signal.signal(signal.SIGTERM, die)
    owner.watch_owner(die)  # an arena never outlives its engine, however the engine ends
    server = ArenaServer(cfg)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m belayer_engine.arena", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
