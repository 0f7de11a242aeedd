"""The arena's CUDA context, kept small: it holds memory and runs only copy kernels.

A CUDA context reserves local memory for every thread the GPU can hold at once, sized by
the per-thread stack limit (1 KiB by default): on an H200 that is ~250 MB of the ~630 MB a
torch process's context takes, measured. The arena's kernels (copies, index copies, fills)
need far less, and the driver raises the reservation for any kernel that needs more, so a
small limit is safe. Worker processes keep the default.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from belayer_core.errors import ArenaLost

log = logging.getLogger(__name__)

STACK_LIMIT = 0  # cudaLimitStackSize


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded into this process (the one its context belongs to)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcudart" in path:
                return ctypes.CDLL(path)
    raise ArenaLost("the CUDA runtime is not loaded in this process")


def set_thread_stack(device: torch.device, nbytes: int) -> tuple[int, int] | None:
    """Set ``device``'s per-thread stack limit to ``nbytes``; (before, after), or None on CPU
    or for ``nbytes == 0`` (the driver's default stays)."""
    if device.type != "cuda" or nbytes == 0:
        return None
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        rt = _cudart()
        before, after = ctypes.c_size_t(), ctypes.c_size_t()
        rt.cudaDeviceGetLimit(ctypes.byref(before), STACK_LIMIT)
        rc = rt.cudaDeviceSetLimit(STACK_LIMIT, ctypes.c_size_t(nbytes))
        if rc != 0:
            raise ArenaLost(f"cudaDeviceSetLimit(stack, {nbytes}) failed with CUDA error {rc}")
        rt.cudaDeviceGetLimit(ctypes.byref(after), STACK_LIMIT)
    log.info("CUDA per-thread stack %d -> %d bytes", before.value, after.value)
    return before.value, after.value
