"""SGLang's ``update_weights_from_tensor`` payload, accepted by value only.

``serialized_named_tensors`` holds one entry per tensor-parallel rank in SGLang's API (each
rank's full, unsharded tensors); this engine writes one update to every rank's shard, so it
takes one entry, or one per rank all equal (what a trainer sends a tp > 1 server). An entry
is base64 of safetensors bytes (``safetensors.torch.save({name: tensor})``): the tensors'
data travels in the request. Its header is checked completely against the served layout
(every name known, the served shape and dtype, offsets that tile the data) and the entry's
length against the header before the rest is decoded, so nothing larger than the tensors
the served model has is ever allocated, and views (strides, overlaps) cannot be expressed.

SGLang's own ``MultiprocessingSerializer`` pickles carry *handles*, not data: a shared-memory
file name and the socket of a torch shared-memory manager (``file_system``), a socket of the
sender (``file_descriptor``), a CUDA IPC handle. Honouring them let a request open, grow or
overwrite any /dev/shm file the engine could open (the arena's live weights included), hold
the engine on a socket that never answers, or describe a stride-0 gigabyte over four bytes
(issue 47). A pickle is refused whole, unread (nothing in it is unpickled), with a 400
naming the by-value form. Torch only for the tensors' views; the router calls it in a thread.
"""

from __future__ import annotations

import base64
import binascii
import warnings
from collections.abc import Mapping

from belayer_core.errors import UsageError
from belayer_engine.weights import wire as weights_wire

FIELD = "serialized_named_tensors"
_HEADER_PER_TENSOR = 512  # bytes of safetensors header one tensor may take (name, dtype, shape, offsets)
_HEADER_BASE = 64 << 10  # and the rest of a header (``__metadata__``)
MAX_RANKS = 64  # entries of one request (SGLang's: one per tensor-parallel rank)

BY_VALUE_HINT = (f"send tensors by value: {FIELD} = [base64.b64encode(safetensors.torch.save("
                 "{name: tensor.cpu()})).decode()] (docs/router.md, 'Weight updates from a trainer')")


def layout_numel(layout: Mapping[str, list[int]]) -> int:
    """Elements of every served tensor together."""
    total = 0
    for shape in layout.values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def max_entry_bytes(layout: Mapping[str, list[int]], itemsize: int) -> int:
    """The most bytes one entry can decode to: every served tensor once, and its header."""
    return 8 + max_header(layout) + layout_numel(layout) * itemsize


def max_header(layout: Mapping[str, list[int]]) -> int:
    return min(weights_wire.MAX_HEADER, _HEADER_BASE + _HEADER_PER_TENSOR * len(layout))


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise UsageError(f"{FIELD}: {what} is not base64: {exc}") from None


def _decoded_length(text: str) -> int:
    if len(text) % 4:
        raise UsageError(f"{FIELD}: not base64: its length {len(text)} is not a multiple of 4")
    return len(text) // 4 * 3 - (len(text) - len(text.rstrip("=")))


def decode_named_tensors(entries, layout: Mapping[str, list[int]], dtype: str) -> dict:
    """``{name: tensor}`` of one update: views over the decoded bytes, checked against the
    served ``layout`` (HF name -> shape) and ``dtype``. Anything else: ``UsageError``."""
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_RANKS \
            or not all(isinstance(e, str) for e in entries):
        raise UsageError(f"{FIELD}: a list of base64 strings, one, or one per tensor-parallel rank (at most "
                         f"{MAX_RANKS})")
    text = entries[0]
    if any(e != text for e in entries[1:]):
        raise UsageError(f"{FIELD}: the ranks' entries differ; this engine writes one update to every rank's "
                         "shard: send the same full tensors to each (or one entry)")
    itemsize = weights_wire.SIZES[dtype]
    total = _decoded_length(text)
    if total > max_entry_bytes(layout, itemsize):
        raise UsageError(f"{FIELD}: {total} bytes, more than every served tensor "
                         f"({max_entry_bytes(layout, itemsize)} bytes with its header)")
    if total < 10:
        raise UsageError(f"{FIELD}: {total} bytes, not a safetensors file; {BY_VALUE_HINT}")
    head = _b64(text[:16], "its start")
    if head[:1] == b"\x80":  # a pickle's PROTO opcode: SGLang's MultiprocessingSerializer
        raise UsageError(f"{FIELD}: a pickle (SGLang's MultiprocessingSerializer) holds handles to the sender's "
                         f"memory (shared-memory files, sockets, CUDA IPC), which this engine never opens; "
                         f"{BY_VALUE_HINT}")
    n = weights_wire.header_length(head[:8])
    if n > min(max_header(layout), total - 8):
        raise UsageError(f"{FIELD}: safetensors header of {n} bytes, more than the entry holds or "
                         f"{max_header(layout)} (the served model's names); {BY_VALUE_HINT}")
    prefix = _b64(text[: -(-(8 + n) // 3) * 4], "its header")
    specs = weights_wire.parse_header(prefix[8 : 8 + n], layout, dtype)
    want = 8 + n + (specs[-1].end if specs else 0)
    if total != want:
        raise UsageError(f"{FIELD}: {total} bytes, its safetensors header describes {want}")
    return _views(_b64(text, "the entry"), 8 + n, specs)


def _views(raw: bytes, start: int, specs: list[weights_wire.Spec]) -> dict:
    import torch

    from belayer_engine.model.weights import torch_dtype

    out = {}
    with warnings.catch_warnings():  # read-only bytes: the views are only read (copied into the arena)
        warnings.simplefilter("ignore", UserWarning)
        for s in specs:
            dt = torch_dtype(s.dtype)
            if s.end == s.begin:
                out[s.name] = torch.empty(s.shape, dtype=dt)
                continue
            count = (s.end - s.begin) // weights_wire.SIZES[s.dtype]
            out[s.name] = torch.frombuffer(raw, dtype=dt, count=count, offset=start + s.begin).view(s.shape)
    return out
