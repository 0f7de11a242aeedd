"""Tokenizers, importable without torch: a byte-level fallback and HF ``tokenizer.json``.

The byte-level tokenizer needs no files: ids 0..255 are bytes, then a few specials. It is
the embedded default model's vocabulary.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

from belayer.errors import ConfigError

BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>")


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes plus specials (256 = <|bos|>, 257 = <|eos|>, 258 = <|im_start|>, ...).

    Special-token strings in the text are encoded as their ids, so ChatML prompts work.
    ``<|eos|>`` and ``<|im_end|>`` end a generation.
    """

    def __init__(self, vocab_size: int = 512):
        if vocab_size < 256 + len(BYTE_SPECIALS):
            raise ConfigError(f"byte tokenizer needs vocab_size >= {256 + len(BYTE_SPECIALS)}")
        self.vocab_size = vocab_size
        self.special_ids = {s: 256 + i for i, s in enumerate(BYTE_SPECIALS)}
        self.special_names = {i: s for s, i in self.special_ids.items()}
        self.eos_token_ids = (self.special_ids["<|eos|>"], self.special_ids["<|im_end|>"])
        self._split = re.compile("(" + "|".join(re.escape(s) for s in BYTE_SPECIALS) + ")")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(self.special_names.get(i, f"<|id{i}|>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A local ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as exc:
            raise ConfigError("tokenizer.json needs the 'tokenizers' package") from exc
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = [self._tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "</s>")]
        self.eos_token_ids = tuple(i for i in eos if i is not None)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir: str | Path | None = None, vocab_size: int = 512) -> Tokenizer:
    """``model_dir/tokenizer.json`` when present and ``tokenizers`` is installed, else bytes."""
    if model_dir is not None:
        path = Path(model_dir) / "tokenizer.json"
        if path.is_file():
            try:
                return HFTokenizer(path)
            except ConfigError:
                pass
    return ByteTokenizer(vocab_size)
