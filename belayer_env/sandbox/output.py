"""Bounded capture of a command's merged output.

A command can print gigabytes; we keep the head and the tail and count what was dropped,
so memory stays bounded and the agent sees both ends with an explicit marker between.
Bytes are decoded once at the end (invalid UTF-8 replaced), never chunk by chunk, so a
multi-byte character split across chunks survives.
"""

from __future__ import annotations

TRUNCATION_MARKER = "\n[... belayer: output truncated: {omitted} of {total} bytes omitted ...]\n"


class OutputCollector:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._head_cap = max_bytes // 2
        self._tail_cap = max_bytes - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            if len(self._tail) > self._tail_cap:
                del self._tail[: len(self._tail) - self._tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > len(self._head) + len(self._tail)

    def text(self) -> str:
        head = bytes(self._head).decode("utf-8", errors="replace")
        if not self.truncated:
            return head + bytes(self._tail).decode("utf-8", errors="replace")
        omitted = self.total - len(self._head) - len(self._tail)
        tail = bytes(self._tail).decode("utf-8", errors="replace")
        return head + TRUNCATION_MARKER.format(omitted=omitted, total=self.total) + tail
