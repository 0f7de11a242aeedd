"""SGLang's KV pool, owned by the arena: the KV of a dead server survives it and its shadow adopts it.

An ``arena.exports.ArenaExport``. Every SGLang server of the slot (worker and shadow) maps the
same pool instead of allocating its own (``kv_hooks/``: the servers' side), so an idle shadow
holds no second pool and promotion resumes nothing. Besides the pool the arena keeps, per
server, what a successor needs to adopt that server's in-flight requests:

- its request-to-token table (SGLang's ``ReqToTokenPool.req_to_token``: the KV slot of every
  position of every running request), written by the server's own kernels;
- its journal (``kv_hooks/belayer_kv_journal.py``): per request row, the token ids and how
  many positions have complete KV, and under which weights version.

Slots are split so that no two live processes ever write the same one: the serving worker
never allocates from its *reserve* (``reserve_tokens`` slots); its shadow warms up there and,
once promoted, allocates only there until the dead worker's process group is gone (``kv_reaped``:
no kernel of it can still write), then takes the whole pool but a new reserve of its own. Its
own shadow gets that new reserve only then.

Ops on the arena's control socket (same-uid peers only): ``kv_attach`` (a starting server:
the pool, its own table and journal, and for a shadow the worker it may succeed),
``kv_source`` (a server's table and journal, for adoption), ``kv_promoted`` (a shadow took over
from its predecessor), ``kv_reaped`` (the supervisor: that server's process group is gone).
"""

from __future__ import annotations

import base64
import itertools
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from belayer_core.errors import UsageError
from belayer_engine.arena.exports import ExportContext
from belayer_engine.arena.shm_files import shm_path

from .kv_hooks import belayer_kv_journal as journal

MAX_TABLE_ELEMENTS = 1 << 31  # rows x cols of one request-to-token table (8 GiB of int32)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _handle(t: torch.Tensor) -> str:
    """A tensor as base64 of torch's ForkingPickler reduction (file_system shm on CPU, CUDA IPC
    on a GPU): the server maps the same memory."""
    from multiprocessing.reduction import ForkingPickler

    return base64.b64encode(ForkingPickler.dumps(t)).decode()


@dataclass
class _Server:
    """One SGLang server that attached: its table and journal in the arena."""

    sid: str
    role: str  # "worker" | "shadow"
    table: torch.Tensor
    journal: journal.Journal
    predecessor: str | None = None  # the server this one took over from (or followed, cold)
    reaped: bool = False
    adopted_from: bool = False  # a successor adopted its requests (its table may go once reaped)
    extra: dict = field(default_factory=dict)


class KvPoolExport:
    """The slot's KV pool, the servers' tables and journals, and who may write where."""

    name = "kv_pool"
    holds_weights = False

    def __init__(self, ctx: ExportContext, reserve_tokens: int):
        self.device = ctx.device
        self.model = ctx.model
        self.reserve_tokens = reserve_tokens
        self.lock = threading.Lock()
        self.pool: torch.Tensor | None = None  # [layers, 2 (k, v), rows, kv heads, head dim]
        self.pool_spec: dict | None = None
        self.servers: dict[str, _Server] = {}
        self.worker: str | None = None  # the server SGLang's requests are routed to
        self.version = 0
        self._names = itertools.count(1)
        if self.device.type == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")

    # ------------------------------------------------------------------ ArenaExport
    def start(self) -> None:
        return None

    def describe(self) -> dict:
        with self.lock:
            return {"pool": self.pool_spec, "worker": self.worker, "version": self.version,
                    "servers": {s.sid: {"role": s.role, "predecessor": s.predecessor, "reaped": s.reaped}
                                for s in self.servers.values()}}

    def checksum(self) -> str | None:
        return None  # KV changes with every token: nothing to compare

    def check_weights(self, tensors) -> None:
        return None

    def update_weights(self, tensors, version: int) -> None:
        return None

    def on_version(self, version: int) -> None:
        """A new weights version is served: KV written from now on carries it; a successor
        never adopts KV of an older version."""
        with self.lock:
            self.version = version
            for s in self.servers.values():
                s.journal.header[journal.H_VERSION] = version

    def ops(self) -> dict:
        return {"kv_attach": self._attach, "kv_source": self._source, "kv_promoted": self._promoted,
                "kv_reaped": self._reaped}

    def close(self) -> None:
        with self.lock:
            for s in list(self.servers.values()):
                self._drop(s)

    # ------------------------------------------------------------------ ops
    def _attach(self, msg: dict, version: int) -> dict:
        sid, role = str(msg["sid"]), str(msg["role"])
        if role not in ("worker", "shadow"):
            raise UsageError(f"kv_attach: role must be worker or shadow, not {role!r}")
        with self.lock:
            self.version = version
            if sid in self.servers:
                raise UsageError(f"kv_attach: server {sid!r} is attached already")
            spec = self._pool_for(msg["pool"])
            rows, cols = int(msg["table"][0]), int(msg["table"][1])
            if rows < 1 or cols < 1 or rows * cols > MAX_TABLE_ELEMENTS:
                raise UsageError(f"kv_attach: request-to-token table {rows} x {cols} refused")
            predecessor = self.worker
            if role == "shadow" and predecessor is None:
                raise UsageError("kv_attach: a shadow needs a serving worker to follow")
            table = self._zeros((rows, cols), torch.int32)
            path = shm_path(f"kvj{next(self._names)}-{os.urandom(8).hex()}")  # reaped with the arena's files
            record = _Server(sid, role, table, journal.create(str(path), rows, cols, self.reserve_tokens, version),
                             predecessor=predecessor)
            self.servers[sid] = record
            if role == "worker":  # a first or cold-started worker: nothing to adopt
                self.worker = sid
                old = self.servers.get(predecessor) if predecessor else None
                self._choose_initial_reserve(record)
                if old is None or old.reaped:
                    record.journal.header[journal.H_RESERVE_READY] = 1
            return {"pool": spec, "pool_handle": self._pool_handle, "table_handle": _handle(table),
                    "journal": str(path), "reserve_tokens": self.reserve_tokens, "version": version,
                    "predecessor": self._describe_source(predecessor)}

    def _source(self, msg: dict, version: int) -> dict:
        with self.lock:
            return {"source": self._describe_source(str(msg["sid"]))}

    def _promoted(self, msg: dict, version: int) -> dict:
        """``sid`` adopted ``predecessor``'s requests and serves now; its reserve (written in
        its journal) becomes its shadow's once the predecessor is reaped."""
        sid, pred = str(msg["sid"]), str(msg["predecessor"])
        with self.lock:
            new, old = self.servers.get(sid), self.servers.get(pred)
            if new is None:
                raise UsageError(f"kv_promoted: unknown server {sid!r}")
            new.role, new.predecessor, self.worker = "worker", pred, sid
            if old is not None:
                old.adopted_from = True
            if old is None or old.reaped:
                new.journal.header[journal.H_RESERVE_READY] = 1
                if old is not None:
                    self._drop(old)
            return {"worker": sid}

    def _reaped(self, msg: dict, version: int) -> dict:
        """The supervisor: ``sid``'s process group is gone. Its successor may now allocate
        anywhere, and the successor's reserve goes to the next shadow."""
        sid = str(msg["sid"])
        with self.lock:
            dead = self.servers.get(sid)
            if dead is None:
                return {"known": False}
            dead.reaped = True
            dead.journal.header[journal.H_REAPED] = 1
            for s in self.servers.values():
                if s.predecessor == sid and s.role == "worker":
                    s.journal.header[journal.H_RESERVE_READY] = 1
            if sid != self.worker or dead.adopted_from:
                if sid == self.worker:
                    self.worker = None
                self._drop(dead)
            return {"known": True}

    # ------------------------------------------------------------------ helpers
    def _pool_for(self, asked: dict) -> dict:
        """The pool, created by the first server to attach with its own shape; later ones must
        ask for the same."""
        spec = {"layers": int(asked["layers"]), "heads": int(asked["heads"]), "head_dim": int(asked["head_dim"]),
                "dtype": str(asked["dtype"]), "tokens": int(asked["tokens"])}
        if spec["dtype"] not in DTYPES:
            raise UsageError(f"kv_attach: KV dtype {spec['dtype']!r} not served (one of {sorted(DTYPES)}); "
                             "FP8 KV is refused: adoption is exact only for the pool's own dtype")
        if self.pool_spec is not None:
            if spec != {k: self.pool_spec[k] for k in spec}:
                raise UsageError(f"kv_attach: pool {spec} differs from the arena's {self.pool_spec}")
            return self.pool_spec
        if spec["layers"] != self.model.num_hidden_layers or spec["heads"] < 1 or spec["head_dim"] < 1 \
                or spec["tokens"] < 1:
            raise UsageError(f"kv_attach: pool {spec} does not fit the model ({self.model.num_hidden_layers} layers)")
        rows = 1 + spec["tokens"] + self.reserve_tokens  # slot 0 absorbs padded writes, as in SGLang
        self.pool = self._zeros((spec["layers"], 2, rows, spec["heads"], spec["head_dim"]), DTYPES[spec["dtype"]])
        self._pool_handle = _handle(self.pool)
        self.pool_spec = {**spec, "rows": rows, "reserve": self.reserve_tokens,
                          "nbytes": self.pool.numel() * self.pool.element_size()}
        return self.pool_spec

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed memory a server maps: torch's file_system shared memory on CPU (as the
        weight cache), a plain allocation exported by CUDA IPC on a GPU."""
        t = torch.zeros(shape, dtype=dtype, device=self.device)
        return t.share_memory_() if self.device.type == "cpu" else t

    def _choose_initial_reserve(self, record: _Server) -> None:
        """A worker with no successor state to build on: the last ``reserve_tokens`` slots."""
        rows = self.pool_spec["rows"]
        record.journal.reserve[:] = range(rows - self.reserve_tokens, rows)

    def _describe_source(self, sid: str | None) -> dict | None:
        s = self.servers.get(sid) if sid else None
        if s is None:
            return None
        return {"sid": s.sid, "journal": s.journal.path, "table_handle": _handle(s.table),
                "table": list(s.table.shape), "reaped": s.reaped}

    def _drop(self, s: _Server) -> None:
        self.servers.pop(s.sid, None)
        s.journal.close()
        Path(s.journal.path).unlink(missing_ok=True)
        s.table = None
