"""The tensors of one ``update_weights`` request, read off the arena's control socket.

Two forms: ``ipc`` (CUDA tensors of a trainer on the same device, by IPC handle; the
socket is 0600 and same-uid only) or ``tensors`` (name, dtype, shape, nbytes per tensor)
followed by exactly ``payload_nbytes`` raw bytes.
"""

from __future__ import annotations

import base64
import pickle

import torch

from belayer_core.errors import UsageError
from belayer_engine.model.weights import torch_dtype


def read_update(msg: dict, rfile) -> dict[str, torch.Tensor]:
    """HF name -> tensor; UsageError when the request's sizes do not add up."""
    if "ipc" in msg:
        handles = pickle.loads(base64.b64decode(msg["ipc"]))
        return {name: fn(*args) for name, (fn, args) in handles.items()}
    specs = msg.get("tensors")
    if not isinstance(specs, list):
        raise UsageError("update_weights needs 'tensors' (a list) or 'ipc'")
    if sum(int(s["nbytes"]) for s in specs) != msg.get("payload_nbytes", 0):
        raise UsageError("update_weights payload size does not match its tensors")
    out = {}
    for s in specs:
        data = bytearray(rfile.read(int(s["nbytes"])))
        out[s["name"]] = torch.frombuffer(data, dtype=torch_dtype(s["dtype"])).view(s["shape"])
    return out
