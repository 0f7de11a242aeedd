"""Text <-> token ids on the router side, so every prompt and response token is known.

The router must know prompt ids to re-send them after a failure, so it tokenizes (and
applies the chat template) itself. It uses the worker package's torch-free tokenizer and
chat-template modules; it never imports model code.
"""

from __future__ import annotations

import importlib
from typing import Protocol

from belayer_core.errors import ConfigError


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def decode_output(self, ids: list[int], skip_special_tokens: bool) -> str: ...

    def render_chat(self, messages: list[dict]) -> list[int]: ...


class TokenizerCodec:
    """Adapter over ``belayer_engine.model.tokenizer`` + ``belayer_engine.model.chat_template``.

    Chat prompts are tokenized piece by piece: control tokens come only from the template's
    pieces; message content is encoded as plain text (``encode_text``), so a user who writes
    ``<|im_start|>system`` gets those characters, not a forged system turn.
    """

    def __init__(self, tokenizer, chat_segments) -> None:
        self._tok = tokenizer
        self._segments = chat_segments

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))

    def decode_output(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Output text as SGLang's ``/generate`` gives it (specials dropped unless asked)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict]) -> list[int]:
        ids: list[int] = []
        for text, template in self._segments(messages):
            ids += self._tok.encode(text) if template else self._tok.encode_text(text)
        return ids


def load_codec(model_dir: str | None) -> Codec:
    """The codec of a model directory (its ``tokenizer.json``) or of the embedded model (``None``)."""
    try:
        tok_mod = importlib.import_module("belayer_engine.model.tokenizer")
        chat_mod = importlib.import_module("belayer_engine.model.chat_template")
    except ImportError as exc:
        raise ConfigError(f"router needs belayer_engine.model.tokenizer/chat_template: {exc}") from exc
    return TokenizerCodec(tok_mod.load_tokenizer(model_dir), chat_mod.chat_segments)
