"""Client of the arena's control socket (trainers, workers, supervisors, tests).

``ArenaClient(path).update_weights(state_dict)`` is what a trainer calls from its own
process; ``attach()`` is what a worker holds for its whole life (its closing is how the
arena learns the worker is gone and frees the live-KV lease).
"""

from __future__ import annotations

import base64
import pickle
import queue
import socket
import threading
import time
from collections.abc import Callable, Mapping

from belayer_core.errors import ArenaLost
from belayer_engine.arena import protocol as proto


def _connect(path: str, timeout: float | None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise ArenaLost(f"arena at {path} unreachable: {exc}") from exc
    return sock


class ArenaClient:
    """One short connection per call; errors come back as ``belayer_core.errors`` types."""

    def __init__(self, socket_path: str, timeout: float = 60.0):
        self.path = str(socket_path)
        self.timeout = timeout

    def _call(self, msg: dict, payload: bytes | memoryview = b"") -> dict:
        sock = _connect(self.path, self.timeout)
        try:
            proto.send(sock, msg, payload)
            reply = proto.recv(sock.makefile("rb"))
        except OSError as exc:
            raise ArenaLost(f"arena at {self.path} failed during {msg.get('op')}: {exc}") from exc
        finally:
            sock.close()
        if reply is None:
            raise ArenaLost(f"arena at {self.path} closed the connection during {msg.get('op')}")
        return proto.raise_if_error(reply)

    def describe(self) -> dict:
        return self._call({"op": "describe"})

    def op(self, name: str, **fields) -> dict:
        """An op one of the arena's exports answers (e.g. the SGLang KV pool's ``kv_reaped``)."""
        return self._call({"op": name, **fields})

    def health(self) -> dict:
        return self._call({"op": "health"})

    def checksums(self) -> dict[str, str]:
        return self._call({"op": "checksums"})

    def register_server(self, url: str, role: str, pid: int = 0, authorization: str | None = None) -> int:
        """Tell a weight-cache arena that the SGLang server at ``url`` maps its weights (it
        is synced now and on every update, with ``authorization`` as its header); returns
        the current version."""
        msg = {"op": "register_server", "url": url, "role": role, "pid": pid, "authorization": authorization}
        return int(self._call(msg)["version"])

    def weight_cache(self) -> dict:
        """The weight cache's state alone (registered servers, version): a small answer,
        read on the handover's critical path."""
        return self._call({"op": "weight_cache"})

    def shutdown(self) -> None:
        self._call({"op": "shutdown"})

    def update_weights(self, state_dict: Mapping, version: int | None = None) -> int:
        """Push new weights (all or some, by HF name); returns the new version once every
        attached worker serves it. CUDA tensors travel as IPC handles (same host).
        ``version``: publish this number (newer than the current one) instead of current + 1."""
        import torch

        extra = {} if version is None else {"version": version}
        tensors = {k: v.detach() for k, v in state_dict.items()}
        if tensors and all(t.is_cuda for t in tensors.values()):
            from torch.multiprocessing.reductions import reduce_tensor

            handles = {k: reduce_tensor(t.contiguous()) for k, t in tensors.items()}
            msg = {"op": "update_weights", "ipc": base64.b64encode(pickle.dumps(handles)).decode(), **extra}
            return int(self._call(msg)["version"])
        specs, chunks = [], []
        for name, t in tensors.items():
            raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            specs.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                          "shape": list(t.shape), "nbytes": len(raw)})
            chunks.append(raw)
        return int(self._call({"op": "update_weights", "tensors": specs, **extra}, b"".join(chunks))["version"])

    def wait_ready(self, timeout: float = 60.0) -> dict:
        """Poll ``describe`` until the arena answers (bounded)."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                return self.describe()
            except ArenaLost as exc:
                last = exc
                time.sleep(0.05)
        raise ArenaLost(f"arena at {self.path} not ready after {timeout}s: {last}")

    def attach(self, role: str, worker_id: str,
               on_version: Callable[[int, int], None],
               on_lost: Callable[[], None] | None = None) -> Attachment:
        return Attachment(self.path, role, worker_id, on_version, on_lost)


class Attachment:
    """A worker's persistent connection: receives version events, sends confirmations."""

    def __init__(self, path: str, role: str, worker_id: str,
                 on_version: Callable[[int, int], None], on_lost: Callable[[], None] | None):
        self.sock = _connect(path, None)
        self.rfile = self.sock.makefile("rb")
        self.on_version, self.on_lost = on_version, on_lost
        self.replies: queue.Queue[dict | None] = queue.Queue()
        self.send_lock = threading.Lock()
        self.alive = True
        proto.send(self.sock, {"op": "attach", "role": role, "worker_id": worker_id})
        first = proto.recv(self.rfile)
        if first is None:
            raise ArenaLost("arena closed the connection while attaching")
        self.info = proto.raise_if_error(first)
        threading.Thread(target=self._reader, name="arena-attachment", daemon=True).start()

    def _reader(self) -> None:
        try:
            while (msg := proto.recv(self.rfile)) is not None:
                if msg.get("event") == "version":
                    self.on_version(int(msg["version"]), int(msg["slot"]))
                else:
                    self.replies.put(msg)
        except (OSError, ValueError):
            pass
        self.alive = False
        self.replies.put(None)
        if self.on_lost is not None:
            self.on_lost()

    def confirm(self, version: int) -> None:
        """Tell the arena this worker now serves ``version`` (and no longer older slots)."""
        try:
            with self.send_lock:
                proto.send(self.sock, {"op": "using", "version": version})
        except OSError:
            pass

    def request(self, msg: dict, timeout: float = 30.0) -> dict:
        with self.send_lock:
            proto.send(self.sock, msg)
        try:
            reply = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise ArenaLost(f"arena did not answer {msg.get('op')} in {timeout}s") from None
        if reply is None:
            raise ArenaLost("arena connection lost")
        return proto.raise_if_error(reply)

    def acquire_kv(self, timeout: float = 30.0) -> None:
        """Take the live-KV lease (refused while another live worker holds it)."""
        self.request({"op": "acquire_kv"}, timeout)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


__all__ = ["ArenaClient", "Attachment"]
