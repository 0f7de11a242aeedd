"""A checkpoint directory's weights for an engine-wide update (SGLang's ``update_weights_from_disk``).

Every ``*.safetensors`` file is opened once, without blocking (a FIFO planted under that
name would otherwise hold the thread forever), and must be a regular file; links are
followed (a Hugging Face cache snapshot is links into its blobs). The files together may
not be larger than the served model in its widest dtype; a file that is not safetensors is
a ``UsageError`` naming it, never its content. Apart from the router, which must not
import torch: the router's route calls it in a thread.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from belayer_core.errors import UsageError
from belayer_engine.weights import wire as weights_wire
from belayer_engine.weights.tensor import layout_numel

_HEADER_ROOM = 1 << 20  # bytes of safetensors header per file on top of the tensors


def _open_regular(f: Path) -> int:
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"model_path: {f.name}: cannot be opened ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"model_path: {f.name} is not a regular file")
    return fd


def load_checkpoint(path: Path, layout: dict[str, list[int]], dtype: str) -> dict:
    """Every tensor of ``path``'s ``*.safetensors`` files, in the served dtype (as SGLang
    casts on load); names and shapes are checked by the arena."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from belayer_engine.model.weights import torch_dtype

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise UsageError(f"model_path {str(path)!r}: no *.safetensors files there")
    limit = layout_numel(layout) * max(weights_wire.SIZES.values()) + _HEADER_ROOM * len(files)
    tensors: dict = {}
    with contextlib.ExitStack() as fds:
        opened = []
        for f in files:
            fd = _open_regular(f)
            fds.callback(os.close, fd)
            opened.append((f, fd))
        size = sum(os.fstat(fd).st_size for _, fd in opened)
        if size > limit:
            raise UsageError(f"model_path {str(path)!r}: {size} bytes of *.safetensors, more than the served "
                             f"model can hold ({limit})")
        for f, fd in opened:
            try:  # the very file checked above, through its descriptor
                tensors.update(load_file(f"/proc/self/fd/{fd}"))
            except (SafetensorError, OSError, ValueError) as exc:
                raise UsageError(f"model_path: {f.name} is not a safetensors file ({type(exc).__name__})") from None
    want = torch_dtype(dtype)
    extra = sorted(set(tensors) - set(layout))
    if extra:
        raise UsageError(f"model_path {str(path)!r}: tensors the served model does not have: {extra[:5]}")
    try:
        return {name: t.to(want) for name, t in tensors.items()}
    except (TypeError, RuntimeError) as exc:  # e.g. a bool or complex tensor
        raise UsageError(f"model_path {str(path)!r}: a tensor cannot become {dtype}: {exc}") from None
