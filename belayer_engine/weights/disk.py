"""A checkpoint directory's weights for an engine-wide update (SGLang's ``update_weights_from_disk``).

Apart from the router, which must not import torch: the router's route calls it in a thread.
"""

from __future__ import annotations

from pathlib import Path

from belayer_core.errors import UsageError


def load_checkpoint(path: Path, layout: dict[str, list[int]], dtype: str) -> dict:
    """Every tensor of ``path``'s ``*.safetensors`` files, in the served dtype (as SGLang
    casts on load); names and shapes are checked by the arena."""
    from safetensors.torch import load_file

    from belayer_engine.model.weights import torch_dtype

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise UsageError(f"model_path {str(path)!r}: no *.safetensors files there")
    tensors: dict = {}
    for f in files:
        tensors.update(load_file(str(f)))
    want = torch_dtype(dtype)
    extra = sorted(set(tensors) - set(layout))
    if extra:
        raise UsageError(f"model_path {str(path)!r}: tensors the served model does not have: {extra[:5]}")
    return {name: t.to(want) for name, t in tensors.items()}
