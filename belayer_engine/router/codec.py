"""Text <-> token ids on the router side, so every prompt and response token is known.

The router must know prompt ids to re-send them after a failure, so it tokenizes (and
applies the chat template) itself. It uses the worker package's torch-free tokenizer and
chat-template modules; it never imports model code.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Protocol

from belayer_core.errors import ConfigError, UsageError


class Codec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def decode_output(self, ids: list[int], skip_special_tokens: bool) -> str: ...

    def render_chat(self, messages: list[dict]) -> list[int]: ...

    def check_ids(self, ids: list[int], where: str) -> None: ...


class TokenizerCodec:
    """Adapter over ``belayer_engine.model.tokenizer`` + ``belayer_engine.model.chat_template``.

    Chat prompts are tokenized piece by piece: control tokens come only from the template's
    pieces; message content is encoded as plain text (``encode_text``), so a user who writes
    ``<|im_start|>system`` gets those characters, not a forged system turn.
    """

    def __init__(self, tokenizer, chat_segments, vocab_size: int | None = None) -> None:
        self._tok = tokenizer
        self._segments = chat_segments
        self.vocab_size = vocab_size

    def check_ids(self, ids: list[int], where: str) -> None:
        """A prompt's ids must lie in the model's vocabulary: an SGLang server indexes its
        embedding with them unchecked and dies (on CPU: an IndexError in its scheduler), and
        so would the replacement the request is then re-sent to."""
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
            bad = next(i for i in ids if i >= self.vocab_size)
            raise UsageError(f"{where}: token id {bad} is outside the model's vocabulary (ids 0..{self.vocab_size - 1})")

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


def load_codec(model_dir: str | None, vocab_size: int | None = None) -> Codec:
    """The codec of a model directory (its ``tokenizer.json``, and its ``config.json``'s
    ``vocab_size`` unless given) or of the embedded model (``None``)."""
    try:
        tok_mod = importlib.import_module("belayer_engine.model.tokenizer")
        chat_mod = importlib.import_module("belayer_engine.model.chat_template")
    except ImportError as exc:
        raise ConfigError(f"router needs belayer_engine.model.tokenizer/chat_template: {exc}") from exc
    if vocab_size is None and model_dir is not None:
        vocab_size = _vocab_size(Path(model_dir) / "config.json")
    return TokenizerCodec(tok_mod.load_tokenizer(model_dir), chat_mod.chat_segments, vocab_size)


def _vocab_size(config: Path) -> int | None:
    """``vocab_size`` of a model's ``config.json``; None when it does not say (no file, another
    layout): the router then leaves the ids to the worker, as it did before it checked them."""
    try:
        value = json.loads(config.read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if type(value) is int and value > 0 else None
