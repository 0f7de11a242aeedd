"""Arena server: one process per device that owns the weights and the KV arena.

Workers come and go (crash, SIGKILL, handover); the memory stays here. A Unix socket
(mode 0600, same-uid peers only) carries JSON-line requests: ``describe``, ``health``,
``checksums``, ``update_weights``, ``shutdown`` and a persistent ``attach`` per worker.

Weight versions are double-buffered and confirmed by every attached worker before
``update_weights`` returns (``versions.py``). Attached workers and the live-KV lease:
``attachments.py``.

Backends whose workers speak another protocol hand the arena ``exports`` (``exports.py``:
SGLang's weight cache and KV pool, built by ``belayer_engine.backends.sglang.arena``).

Run: ``python -m belayer_engine.arena --socket PATH [--device cpu|cuda:N] [model options]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from belayer_core.errors import ArenaLost, BelayerError, UsageError
from belayer_engine.arena import memory as mem
from belayer_engine.arena import protocol as proto
from belayer_engine.arena.attachments import Attachments
from belayer_engine.arena.config import FLAGS, ArenaConfig, add_flags
from belayer_engine.arena.cuda_limits import set_thread_stack
from belayer_engine.arena.device_check import check_device
from belayer_engine.arena.exports import ArenaExport, ExportContext, ExportFactory
from belayer_engine.arena.payload import read_update
from belayer_engine.arena.versions import WeightVersions
from belayer_engine.common import owner
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import init_weights, load_safetensors_dir, torch_dtype


class ArenaServer(WeightVersions):
    """Allocates the regions and answers the control socket; weight-version updates are
    ``WeightVersions`` (``versions.py``)."""

    def __init__(self, cfg: ArenaConfig, exports: Sequence[ExportFactory] = ()):
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
        context = ExportContext(self.model, weights, self.device)
        self.exports: list[ArenaExport] = [make(context) for make in exports]
        if not self.slots and not any(e.holds_weights for e in self.exports):
            raise UsageError("--no-reference-slots needs an export that holds the weights (the SGLang "
                             "arena's --weight-cache-socket): this arena would hold no weights")
        for export in self.exports:
            export.start()
        del weights, context
        if self.device.type == "cuda":  # the loaded HF tensors' blocks go back to the device
            torch.cuda.empty_cache()
        self.cuda_stack = set_thread_stack(self.device, cfg.cuda_stack_bytes)  # (before, after) bytes; None on CPU
        ok, detail = check_device(self.device, self.handles)  # loads its kernels before any handover
        if not ok:
            raise ArenaLost(f"arena on {self.device}: the device check failed at start: {detail}")
        self.version, self.slot = 0, 0
        self.links = Attachments(cfg.lease_wait_s)  # reference workers: versions confirmed, KV lease
        self.cond = self.links.cond
        self.update_lock = threading.Lock()
        self.server: socketserver.ThreadingUnixStreamServer | None = None

    # ------------------------------------------------------------------ answers
    def describe(self) -> dict:
        return {"arena_id": f"{os.getpid()}", "owner_pid": os.getpid(), "device": str(self.device),
                "model": self.model.to_dict(), "layout": self.layout, "regions": self.handles,
                "kv": {"num_blocks": self.cfg.num_blocks, "block_size": self.cfg.block_size,
                       "scratch_blocks": self.cfg.scratch_blocks},
                "version": self.version, "slot": self.slot, "cuda_stack": self.cuda_stack,
                **self._described_exports()}

    def health(self) -> dict:
        device_ok, detail = check_device(self.device, self.handles)
        attached = self.links.listing()
        return {"status": "ok" if device_ok else "unhealthy", "owner_pid": os.getpid(),
                "device": str(self.device), "device_ok": device_ok, "device_detail": detail,
                "version": self.version, "uptime_s": time.time() - self.started,
                "attached": attached, **self._described_exports()}

    def _described_exports(self) -> dict:
        return {e.name: e.describe() for e in self.exports}

    def checksums(self) -> dict:
        """sha256 of each weight slot, of the live KV blocks and of the scratch blocks (and of
        of what each export serves)."""
        out = {e.name: digest for e in self.exports if (digest := e.checksum()) is not None}
        if not self.slots:
            return out
        out.update({name: mem.checksum(self.regions[name]) for name in ("w0", "w1")})
        kv = mem.kv_view(self.regions["kv"], self.model, self.cfg.num_blocks +
                         self.cfg.scratch_blocks, self.cfg.block_size)
        out["kv"] = mem.checksum(kv[:, :, : self.cfg.num_blocks].contiguous().view(-1))
        out["scratch"] = mem.checksum(kv[:, :, self.cfg.num_blocks :].contiguous().view(-1))
        return out

    def export_op(self, op: str, msg: dict) -> dict | None:
        """An op an export answers (under the update lock: no weight update meanwhile), or None."""
        for export in self.exports:
            handler = export.ops().get(op)
            if handler is not None:
                with self.update_lock:
                    return handler(msg, self.version)
        return None

    def _op_names(self) -> str:
        names = ["describe", "health", "checksums", "update_weights", "attach", "shutdown"]
        return ", ".join(names + [op for e in self.exports for op in e.ops()])

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
                    self._attach(sock, rfile, msg)
                    return
                if op == "describe":
                    reply = self.describe()
                elif op == "health":
                    reply = self.health()
                elif op == "checksums":
                    reply = self.checksums()
                elif op == "update_weights":
                    reply = {"version": self.update_weights(read_update(msg, rfile), msg.get("version"))}
                elif op == "shutdown":
                    reply = {"status": "stopping"}  # sent first; the stop starts after the send below
                elif (answer := self.export_op(str(op), msg)) is not None:
                    reply = answer
                else:
                    raise UsageError(f"unknown op {op!r} (this arena serves {self._op_names()})")
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

    def _attach(self, sock: socket.socket, rfile, msg: dict) -> None:
        role = msg.get("role", "active")
        if role not in ("active", "shadow"):
            raise UsageError("attach role must be 'active' or 'shadow'")
        if not self.slots:
            raise UsageError("this arena holds no reference-worker slots (started with --no-reference-slots): "
                             "only its exports' clients (SGLang's weight cache) map its weights")
        self.links.serve(sock, rfile, role, str(msg.get("worker_id", "?")), lambda: self.version, self.describe)

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
        for export in self.exports:
            export.close()
        for h in self.handles.values():
            if h["kind"] == "shm":
                Path(h["path"]).unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    return serve(FLAGS.build(args))


def serve(cfg: ArenaConfig, exports: Sequence[ExportFactory] = ()) -> int:
    """Serve the arena ``cfg`` describes, with ``exports`` (what a backend adds), until
    SIGTERM or the owner's death."""
    torch.set_num_threads(1)
    server: ArenaServer | None = None

    def die(*_) -> None:
        """SIGTERM (a clean engine stop) or the owner's death: remove the shm files, exit."""
        if server is not None:
            server.cleanup()
        os._exit(0)

    signal.signal(signal.SIGTERM, die)
    owner.watch_owner(die)  # an arena never outlives its engine, however the engine ends
    server = ArenaServer(cfg, exports)
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
