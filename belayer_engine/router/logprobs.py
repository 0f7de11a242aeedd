"""OpenAI ``logprobs`` objects from the token ids and the workers' logprob values.

Token strings come from the router's codec, one token decoded alone (so a token that is
part of a multi-byte character reads as U+FFFD, as in OpenAI's own output); ``bytes`` is
the token string's UTF-8, or null where the token is such a fragment. Chat:
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``.
Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``, where ``text_offset`` is each token's start in the completion text (a
top dict has fewer than k keys where two ids read the same).
"""

from __future__ import annotations

from .codec import Codec


class LogprobFormatter:
    """Builds the ``logprobs`` of one choice, for a whole response or chunk by chunk."""

    def __init__(self, codec: Codec, chat: bool) -> None:
        self.codec = codec
        self.chat = chat
        self._names: dict[int, str] = {}
        self._ids: list[int] = []  # every token formatted so far (text offsets)

    def token(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            name = self._names[token_id] = self.codec.decode([token_id])
        return name

    def _entry(self, token_id: int, logprob: float) -> dict:
        name = self.token(token_id)
        return {"token": name, "logprob": logprob, "bytes": None if "\ufffd" in name else list(name.encode())}

    def part(self, ids: list[int], logprobs: list[float], top: list[list[tuple[float, int]]] | None) -> dict:
        """The logprobs object for the next ``ids`` of this choice (one entry per id)."""
        tops = top if top is not None else [[] for _ in ids]
        if self.chat:
            content = []
            for i, lp, row in zip(ids, logprobs, tops, strict=True):
                content.append({**self._entry(i, lp), "top_logprobs": [self._entry(t, v) for v, t in row]})
            return {"content": content, "refusal": None}
        offsets = []
        for i in ids:
            offsets.append(len(self.codec.decode(self._ids).rstrip("\ufffd")) if self._ids else 0)
            self._ids.append(i)
        return {"tokens": [self.token(i) for i in ids], "token_logprobs": list(logprobs),
                "top_logprobs": [self._top_dict(row) for row in tops], "text_offset": offsets}

    def _top_dict(self, row: list[tuple[float, int]]) -> dict[str, float]:
        """Token string -> logprob; where two ids read the same, the likelier one's value."""
        out: dict[str, float] = {}
        for v, t in row:
            out.setdefault(self.token(t), v)
        return out
