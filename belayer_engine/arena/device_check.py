"""Whether the arena's device still works: asked at start and at every handover.

On a GPU a kernel runs and its result comes back; on CPU every shared-memory region the
workers map must still exist. The first check in a process loads its CUDA kernels (CUDA
loads them lazily: 20-40 ms on an H200), so the arena runs it once at start, off the first
handover's critical path.
"""

from __future__ import annotations

from pathlib import Path

import torch


def check_device(device: torch.device, handles: dict[str, dict]) -> tuple[bool, str]:
    """(ok, detail); a failing device answers not ok, never raises."""
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            probe = torch.ones(1, device=device)
            ok = float((probe + 1).item()) == 2.0
            free, total = torch.cuda.mem_get_info(device)
            return ok, f"free {free >> 20} MiB of {total >> 20} MiB"
        gone = [h["path"] for h in handles.values() if not Path(h["path"]).is_file()]
        return not gone, f"missing {gone}" if gone else "ok"
    except Exception as exc:  # a failing device answers not ok, never crashes the arena
        return False, f"{type(exc).__name__}: {exc}"
