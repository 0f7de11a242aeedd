"""Shape of a Qwen3-style decoder, readable from a Hugging Face ``config.json``.

A plain dataclass (not pydantic) so the torch-only GPU paths import nothing else.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from belayer_core.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """Decoder dimensions. Defaults are the embedded small model (fast on 2 CPU cores)."""

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    qk_norm: bool = True
    dtype: str = "float32"

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ConfigError("head_dim must be even (RoPE rotates halves)")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ConfigError(f"unsupported dtype {self.dtype!r}")

    @classmethod
    def qwen3_4b(cls) -> ModelConfig:
        """Qwen3-4B's shape (for GPU benchmarks with random weights)."""
        return cls(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                   num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                   head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                   max_position_embeddings=40960, tie_word_embeddings=True, dtype="bfloat16")

    @classmethod
    def qwen3_14b(cls) -> ModelConfig:
        """Qwen3-14B's shape (29.5 GB in bf16; GPU benchmarks with random weights)."""
        return cls(vocab_size=151936, hidden_size=5120, intermediate_size=17408,
                   num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                   head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                   max_position_embeddings=40960, tie_word_embeddings=False, dtype="bfloat16")

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """Build from a parsed HF ``config.json`` (Qwen3 / Qwen2 / Llama-like keys)."""
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qk_norm=str(cfg.get("model_type", "qwen3")).startswith("qwen3"),
                dtype=str(cfg.get("torch_dtype", "float32")),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks required key {exc.args[0]!r}") from exc

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"no config.json in {path}")
        return cls.from_hf(json.loads(p.read_text()))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_hf(self) -> dict:
        """A ``config.json`` that :meth:`from_hf` reads back to the same config."""
        d = self.to_dict()
        d["model_type"] = "qwen3" if self.qk_norm else "qwen2"
        d["torch_dtype"] = d.pop("dtype")
        d.pop("qk_norm")
        d["architectures"] = ["Qwen3ForCausalLM" if self.qk_norm else "Qwen2ForCausalLM"]
        return d


def kv_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Layout of the KV arena: (layers, k|v, blocks, block_size, kv_heads, head_dim)."""
    return (cfg.num_hidden_layers, 2, num_blocks, block_size, cfg.num_key_value_heads,
            cfg.head_dim)
