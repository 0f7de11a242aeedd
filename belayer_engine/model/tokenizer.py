"""Tokenizers, importable without torch: a byte-level fallback and HF ``tokenizer.json``.

The byte-level tokenizer needs no files: ids 0..255 are bytes, then a few specials. It is
the embedded default model's vocabulary.

``encode`` turns special-token strings into their control ids (a raw prompt written in
the template's format, as SGLang does); ``encode_text`` never does, so text that came from
a user (chat message content) can never inject ``<|im_start|>`` and forge a turn.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol

from belayer_core.errors import ConfigError

BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>")


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]: ...

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

    def encode_text(self, text: str) -> list[int]:
        """Plain UTF-8 bytes: special-token strings stay text."""
        return list(text.encode("utf-8"))

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
        specials = _special_strings(Path(path))
        self._specials = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) if specials else None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str) -> list[int]:
        """Like ``encode``, but a special-token string in ``text`` is tokenized as text: it is
        split after its first character, and each part is encoded on its own."""
        if self._specials is None or not self._specials.search(text):
            return self.encode(text)
        ids: list[int] = []
        pos = 0
        for m in self._specials.finditer(text):
            if m.start() > pos:
                ids += self.encode(text[pos : m.start()])
            ids += self.encode(m.group()[:1]) + self.encode_text(m.group()[1:])
            pos = m.end()
        if pos < len(text):
            ids += self.encode(text[pos:])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _special_strings(path: Path) -> list[str]:
    """The special added tokens of a ``tokenizer.json`` (what a chat template emits)."""
    try:
        added = json.loads(path.read_text()).get("added_tokens") or []
    except (OSError, ValueError):
        return []
    return [t["content"] for t in added if isinstance(t, dict) and t.get("special") and t.get("content")]


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
