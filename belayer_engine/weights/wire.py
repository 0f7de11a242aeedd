"""The body of a weight update sent to the engine: the safetensors layout, streamed.

``u64 little-endian header length | JSON header | tensor bytes``, the header mapping each HF
name to ``{"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}`` (offsets into
the bytes after the header). A file written by ``safetensors.torch.save_file`` is a valid
body as it is; the client below streams tensor by tensor instead, so a large model is never
joined into one buffer. The header is checked completely (names, shapes, dtypes, offsets)
before any tensor byte is read. Torch-free except ``encode``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from belayer_core.errors import UsageError

ROUTE = "/v1/weights"  # on the engine's weight socket
MAX_HEADER = 1 << 26  # names and shapes of any real model stay far below this

# safetensors dtype tag <-> the model config's dtype name (the dtypes a model may have)
TAGS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
SIZES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Spec:
    """One tensor of a body: where its bytes are, once the header is read."""

    name: str
    dtype: str  # the config's name ("float32")
    shape: tuple[int, ...]
    begin: int
    end: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise UsageError(f"weights header names a tensor twice: {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def header_length(prefix: bytes) -> int:
    """The JSON header's length from the body's first 8 bytes."""
    if len(prefix) != 8:
        raise UsageError("weights body too short: no safetensors header length")
    (n,) = struct.unpack("<Q", prefix)
    if not 2 <= n <= MAX_HEADER:
        raise UsageError(f"weights header length {n} out of range (2..{MAX_HEADER})")
    return n


def parse_header(raw: bytes, layout: Mapping[str, list[int]], dtype: str) -> list[Spec]:
    """The tensors of a body, in byte order, checked against the served model: every name
    known (``layout``: HF name -> shape), the model's ``dtype``, offsets that tile the data
    with no gap or overlap. Any problem: ``UsageError`` naming the tensor."""
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, UsageError):
            raise
        raise UsageError(f"weights header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise UsageError("weights header must be a JSON object")
    header.pop("__metadata__", None)
    if not header:
        raise UsageError("weights body holds no tensor")
    specs = []
    for name, entry in header.items():
        if name not in layout:
            raise UsageError(f"unknown weight {name!r}")
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise UsageError(f"{name}: header entry needs exactly dtype, shape, data_offsets")
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if TAGS.get(tag) != dtype:
            raise UsageError(f"{name}: dtype {tag!r}, the served weights are {dtype} "
                             f"({next(t for t, d in TAGS.items() if d == dtype)}); convert before sending")
        if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            raise UsageError(f"{name}: shape must be a list of non-negative ints, got {shape!r}")
        if shape != list(layout[name]):
            raise UsageError(f"{name}: shape {shape} != {list(layout[name])}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise UsageError(f"{name}: data_offsets must be [begin, end], got {offsets!r}")
        numel = 1
        for s in shape:
            numel *= s
        begin, end = offsets
        if end - begin != numel * SIZES[dtype]:
            raise UsageError(f"{name}: data_offsets {offsets} hold {end - begin} bytes, "
                             f"shape {shape} {dtype} needs {numel * SIZES[dtype]}")
        specs.append(Spec(name, dtype, tuple(shape), begin, end))
    specs.sort(key=lambda s: s.begin)
    at = 0
    for s in specs:
        if s.begin != at:
            raise UsageError(f"{s.name}: data starts at {s.begin}, expected {at} (gap or overlap)")
        at = s.end
    return specs


def encode(state_dict: Mapping[str, Any]) -> tuple[int, Iterator[memoryview | bytes]]:
    """A body for ``state_dict`` (HF name -> tensor, any device): its length and its pieces
    (the header, then each tensor's bytes as a view of a host copy, made one at a time)."""
    import torch

    dtypes = {getattr(torch, name): tag for tag, name in TAGS.items()}
    tensors = {k: v.detach() for k, v in state_dict.items()}
    header: dict[str, Any] = {}
    at = 0
    for name, t in tensors.items():
        if t.dtype not in dtypes:
            raise UsageError(f"{name}: dtype {t.dtype} cannot be sent (use one of {sorted(TAGS.values())})")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces

    def pieces() -> Iterator[memoryview | bytes]:
        yield struct.pack("<Q", len(raw)) + raw
        for t in tensors.values():
            if t.numel():
                yield memoryview(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())

    return 8 + len(raw) + at, pieces()
