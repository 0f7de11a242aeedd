"""The arena's memory: flat byte regions, their layout, and how other processes map them.

Regions: ``w0`` and ``w1`` (two weight slots, so a new version is written while the old
one is still being served) and ``kv``: the paged KV arena, whose last ``scratch_blocks``
blocks are never handed to requests. A shadow warms up (and on CUDA captures its graphs)
against those scratch blocks: the same tensor, so the same addresses as the live blocks,
without writing any live block before it is activated. On CPU each region is a file in
``/dev/shm`` mapped ``MAP_SHARED`` (``torch.from_file``); on CUDA it is a device
allocation exported as a pickled CUDA IPC handle. Either way a worker maps it without a copy.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
from pathlib import Path

import torch

from belayer_core.errors import ArenaLost
from belayer_engine.arena.shm_files import reap_orphans, shm_path  # noqa: F401 - reap_orphans re-exported
from belayer_engine.model.config import ModelConfig, kv_shape
from belayer_engine.model.weights import torch_dtype, weight_specs

ALIGN = 64


def weight_layout(cfg: ModelConfig) -> tuple[dict[str, list], int]:
    """name -> [byte offset, shape]; plus the slot size. Offsets are 64-byte aligned."""
    esize = torch.empty(0, dtype=torch_dtype(cfg.dtype)).element_size()
    layout, off = {}, 0
    for name, shape in weight_specs(cfg).items():
        layout[name] = [off, list(shape)]
        numel = 1
        for s in shape:
            numel *= s
        off += -(-numel * esize // ALIGN) * ALIGN
    return layout, off


def weight_views(flat: torch.Tensor, layout: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Typed views of every weight inside one flat uint8 slot (no copy)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    out = {}
    for name, (off, shape) in layout.items():
        numel = 1
        for s in shape:
            numel *= s
        out[name] = flat[off : off + numel * esize].view(dtype).view(shape)
    return out


def kv_view(flat: torch.Tensor, cfg: ModelConfig, num_blocks: int, block_size: int):
    return flat.view(torch_dtype(cfg.dtype)).view(kv_shape(cfg, num_blocks, block_size))


def kv_nbytes(cfg: ModelConfig, num_blocks: int, block_size: int) -> int:
    numel = 1
    for s in kv_shape(cfg, num_blocks, block_size):
        numel *= s
    return numel * torch.empty(0, dtype=torch_dtype(cfg.dtype)).element_size()


def allocate(name: str, nbytes: int, device: torch.device) -> tuple[torch.Tensor, dict]:
    """A zeroed flat region plus the handle another process needs to map it."""
    if device.type == "cpu":
        path = shm_path(name)
        path.unlink(missing_ok=True)
        t = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        os.chmod(path, 0o600)
        return t, {"kind": "shm", "path": str(path), "nbytes": nbytes}
    from torch.multiprocessing.reductions import reduce_tensor

    t = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    handle = base64.b64encode(pickle.dumps(reduce_tensor(t))).decode()
    return t, {"kind": "cuda_ipc", "handle": handle, "nbytes": nbytes}


def map_region(handle: dict) -> torch.Tensor:
    """Map a region exported by :func:`allocate` into this process (no copy)."""
    if handle["kind"] == "shm":
        path = Path(handle["path"])
        if not path.is_file() or path.stat().st_size < handle["nbytes"]:
            raise ArenaLost(f"arena region {path} is gone")
        return torch.from_file(str(path), shared=True, size=handle["nbytes"], dtype=torch.uint8)
    if handle["kind"] == "cuda_ipc":
        fn, args = pickle.loads(base64.b64decode(handle["handle"]))
        return fn(*args)
    raise ArenaLost(f"unknown region kind {handle['kind']!r}")


def checksum(t: torch.Tensor) -> str:
    """sha256 of a flat region's bytes (copied to host first on CUDA)."""
    data = t.detach().cpu() if t.device.type != "cpu" else t
    data = data.contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(data.numpy())).hexdigest()
