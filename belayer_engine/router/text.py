"""Incremental detokenization with stop strings, done on the router over all token ids.

Decoding the whole id list (not per-worker text pieces) keeps the text exact across a
splice, even when a multi-byte character straddles the failure point.
"""

from __future__ import annotations

from .codec import Codec


class TextStream:
    """Feed token ids, get the new text; holds back incomplete UTF-8 and stop-string prefixes."""

    def __init__(self, codec: Codec, stop: list[str] | None = None) -> None:
        self.codec = codec
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        full = self.codec.decode(self.ids)
        for s in self.stop:
            at = full.find(s, max(0, len(self.emitted) - len(s)))
            if at >= 0:
                full = full[:at]
                self.stopped = True
                final = True
        ready = full
        if not final:
            if ready.endswith("\ufffd"):
                ready = ready.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in self.stop), default=0)
            if hold:
                ready = ready[: max(len(self.emitted), len(ready) - hold)]
        if not ready.startswith(self.emitted):
            # Earlier text changed (should not happen with byte-exact decoding): never resend.
            return ""
        delta = ready[len(self.emitted) :]
        self.emitted = ready
        return delta
