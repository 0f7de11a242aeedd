"""SGLang's ``update_weights_from_tensor`` payload, decoded without running the sender's code.

Each entry of ``serialized_named_tensors`` is base64 of a ``ForkingPickler`` pickle of
``[(name, tensor), ...]`` (SGLang's ``MultiprocessingSerializer``): tensors travel as
handles to shared memory (torch's ``file_system`` sharing strategy on CPU, CUDA IPC on a
GPU), not as bytes. Unpickling anything from HTTP would run what the pickle names, so only
torch's own rebuild functions, ``torch.Tensor``/``Size``/``UntypedStorage`` and dtypes may
be named; anything else (including the ``file_descriptor`` strategy, whose pickles name a
socket listener of the sender) is a ``UsageError`` naming it. Apart from the router, which
must not import torch: the router's route calls it in a thread.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle

from belayer_core.errors import UsageError

_REBUILD = "torch.multiprocessing.reductions"
_ALLOWED = {
    (_REBUILD, "rebuild_tensor"), (_REBUILD, "rebuild_typed_storage"), (_REBUILD, "rebuild_storage_filename"),
    (_REBUILD, "rebuild_cuda_tensor"), ("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage"),
    ("torch.nn.parameter", "Parameter"),
}


class _TensorsOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        hint = (" (send with torch.multiprocessing.set_sharing_strategy('file_system'))"
                if module.startswith("multiprocessing") or name == "rebuild_storage_fd" else "")
        raise UsageError(f"serialized_named_tensors: {module}.{name} is not a tensor rebuild function{hint}")


def decode_named_tensors(entries) -> dict:
    """``{name: tensor}`` of SGLang's ``serialized_named_tensors`` (one entry: tp_size 1)."""
    import torch
    import torch.multiprocessing  # noqa: F401 - registers the rebuild functions' module

    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], str):
        raise UsageError("serialized_named_tensors: a list of one base64 string (this engine's workers have tp_size 1)")
    try:
        raw = base64.b64decode(entries[0], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UsageError(f"serialized_named_tensors: not base64: {exc}") from exc
    try:
        named = _TensorsOnly(io.BytesIO(raw)).load()
    except UsageError:
        raise
    except Exception as exc:  # a truncated pickle, a shared-memory file that is gone, ...
        raise UsageError(f"serialized_named_tensors: cannot be decoded: {type(exc).__name__}: {exc}") from exc
    if not isinstance(named, list | tuple) or not all(
            isinstance(p, list | tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named):
        raise UsageError("serialized_named_tensors: each entry must hold a list of (name, tensor) pairs")
    if not named:
        raise UsageError("serialized_named_tensors: no tensors")
    return {name: t.detach() for name, t in named}
