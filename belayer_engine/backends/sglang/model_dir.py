"""The embedded model for SGLang: a small random Qwen3 in HF layout, made locally.

SGLang loads models from an HF-layout directory (``config.json``, ``*.safetensors``,
tokenizer files). ``model=None`` must work without a download, so this module writes
one: the reference backend's shape and seeded init (``weights.py``), an untied output
layer scaled up so greedy decoding is not tie-prone (a random model's logits are close
together; a tiny numerical difference between batch compositions would then flip an
argmax), and a byte-level ``tokenizer.json`` whose ids equal the reference backend's
``ByteTokenizer`` (ids 0..255 are bytes, then ``<|bos|>``, ``<|eos|>``, ``<|im_start|>``,
``<|im_end|>``, ``<|pad|>``), so the router's codec and SGLang agree on every id.

The directory is cached by content under ``~/.cache/belayer/sglang-models/<hash>``
(``BELAYER_CACHE_DIR`` overrides the root) and written atomically (temp dir + rename).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from belayer_engine.model.config import ModelConfig
from belayer_engine.model.tokenizer import BYTE_SPECIALS

FORMAT = 1  # bump when the files written here change
LM_HEAD_SCALE = 8.0  # logits std ~8 instead of ~1: top-2 gaps far above float noise
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def embedded_config(**overrides) -> ModelConfig:
    """The reference backend's small shape, with an untied output layer."""
    return dataclasses.replace(ModelConfig(), tie_word_embeddings=False, **overrides)


def cache_root() -> Path:
    base = os.environ.get("BELAYER_CACHE_DIR") or os.path.join(Path.home(), ".cache", "belayer")
    return Path(base) / "sglang-models"


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def tokenizer_json() -> dict:
    """A ``tokenizers`` file equal to ``ByteTokenizer``: one token per byte, no merges."""
    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    added = [{"id": 256 + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, s in enumerate(BYTE_SPECIALS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": []}}


def _special(name: str) -> int:
    return 256 + BYTE_SPECIALS.index(name)


def hf_config(cfg: ModelConfig) -> dict:
    """``config.json``: ``ModelConfig.to_hf()`` plus what transformers' Qwen3Config reads."""
    d = cfg.to_hf()
    d.update(hidden_act="silu", attention_bias=False, attention_dropout=0.0,
             use_sliding_window=False, sliding_window=None,
             max_window_layers=cfg.num_hidden_layers,
             rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
             bos_token_id=_special("<|bos|>"),
             eos_token_id=[_special("<|eos|>"), _special("<|im_end|>")],
             pad_token_id=_special("<|pad|>"), initializer_range=0.02, use_cache=True)
    return d


def _files(cfg: ModelConfig) -> dict[str, str]:
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings,
                  "bos_token": "<|bos|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
                  "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    gen = {"bos_token_id": _special("<|bos|>"),
           "eos_token_id": [_special("<|eos|>"), _special("<|im_end|>")]}
    return {"config.json": json.dumps(hf_config(cfg), indent=1),
            "tokenizer.json": json.dumps(tokenizer_json(), ensure_ascii=False),
            "tokenizer_config.json": json.dumps(tok_config, indent=1),
            "special_tokens_map.json": json.dumps({"bos_token": "<|bos|>", "eos_token": "<|im_end|>",
                                                   "pad_token": "<|pad|>"}),
            "generation_config.json": json.dumps(gen)}


def ensure_embedded_model(seed: int = 0, cfg: ModelConfig | None = None,
                          root: Path | None = None) -> Path:
    """The embedded model's directory, written once per content (config, seed, format)."""
    cfg = cfg or embedded_config()
    files = _files(cfg)
    key = hashlib.sha256(json.dumps({"format": FORMAT, "seed": seed, "scale": LM_HEAD_SCALE,
                                     "files": files}, sort_keys=True).encode()).hexdigest()[:16]
    root = root or cache_root()
    target = root / f"qwen3-random-{key}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        _write(tmp, cfg, seed, files)
        try:
            tmp.rename(target)
        except OSError:  # another process wrote the same content first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(path: Path, cfg: ModelConfig, seed: int, files: dict[str, str]) -> None:
    from belayer_engine.model.weights import init_weights, save_safetensors_dir

    weights = init_weights(cfg, seed)
    if "lm_head.weight" in weights:
        weights["lm_head.weight"] = weights["lm_head.weight"] * LM_HEAD_SCALE
    save_safetensors_dir(path, cfg, weights)
    for name, text in files.items():  # after save_safetensors_dir: our config.json wins
        (path / name).write_text(text)
