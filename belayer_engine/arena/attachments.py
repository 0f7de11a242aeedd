"""Reference workers attached to the arena: the version each has confirmed, and the lease.

Each reference worker (and shadow) keeps one ``attach`` connection open for its life. On it
the arena pushes new weight versions and the worker confirms the one it switched to
(``using``); the arena's weight update waits on those confirmations (``all_on``). Only one
attached worker holds the live-KV lease at a time; the lease is freed when its connection
closes, i.e. when that process is gone, so a shadow can never write live KV beside a worker
that is still running.
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from belayer_core.errors import BelayerError, UsageError
from belayer_engine.arena import protocol as proto


@dataclass
class Attached:
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


class Attachments:
    """Every attached connection, under one condition the weight updates wait on."""

    def __init__(self, lease_wait_s: float) -> None:
        self.lease_wait_s = lease_wait_s
        self.cond = threading.Condition()
        self.attached: dict[int, Attached] = {}
        self.kv_holder: int | None = None
        self._ids = itertools.count(1)

    def listing(self) -> list[dict]:
        with self.cond:
            return [{"role": a.role, "worker_id": a.worker_id, "pid": a.pid, "version": a.version,
                     "kv_lease": a.conn_id == self.kv_holder, "kv_waiting": a.waiting_kv}
                    for a in self.attached.values()]

    def all_on(self, version: int) -> bool:
        """Every attached worker confirmed ``version`` (call under ``cond``)."""
        return all(a.version >= version for a in self.attached.values())

    def laggards(self, version: int) -> list[str]:
        return [f"{a.worker_id}(pid {a.pid}, v{a.version})" for a in self.attached.values()
                if a.version < version]

    def push_all(self, msg: dict) -> None:
        for a in list(self.attached.values()):
            a.push(msg)

    def acquire_lease(self, conn: Attached) -> None:
        with self.cond:
            conn.waiting_kv = True
            try:
                free = self.cond.wait_for(lambda: self.kv_holder in (None, conn.conn_id), self.lease_wait_s)
            finally:
                conn.waiting_kv = False
            if not free:
                holder = self.attached.get(self.kv_holder)
                who = f"{holder.worker_id} (pid {holder.pid})" if holder else "?"
                raise UsageError(f"live KV is held by {who}; fence it before activating another")
            self.kv_holder = conn.conn_id
            conn.role = "active"

    def serve(self, sock: socket.socket, rfile, role: str, worker_id: str, version: Callable[[], int],
              describe: Callable[[], dict]) -> None:
        """One attached connection, until it closes: attach reply, version confirmations,
        lease requests, pings."""
        with self.cond:
            conn = Attached(next(self._ids), role, worker_id, proto.peer_pid(sock), version(), sock)
            self.attached[conn.conn_id] = conn
            reply = {"reply": "attach", **describe()}
        try:
            try:
                if role == "active":
                    self.acquire_lease(conn)
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
                        self.acquire_lease(conn)
                        conn.push({"reply": "acquire_kv", "ok": True})
                    except BelayerError as exc:
                        conn.push({"reply": "acquire_kv", **proto.error_reply(exc)})
                elif op == "ping":
                    conn.push({"reply": "ping", "version": version()})
        finally:
            with self.cond:
                self.attached.pop(conn.conn_id, None)
                if self.kv_holder == conn.conn_id:
                    self.kv_holder = None
                self.cond.notify_all()
