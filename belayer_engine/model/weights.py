"""Weight names and shapes of a Qwen3-style decoder (HF layout), seeded init, safetensors IO."""

from __future__ import annotations

from pathlib import Path

import torch

from belayer_core.errors import ConfigError
from belayer_engine.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}") from None


def weight_specs(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, in a fixed order (the arena lays them out in it)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    specs: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = (h,)
        specs[p + "self_attn.q_proj.weight"] = (q, h)
        specs[p + "self_attn.k_proj.weight"] = (kv, h)
        specs[p + "self_attn.v_proj.weight"] = (kv, h)
        specs[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.qk_norm:
            specs[p + "self_attn.q_norm.weight"] = (d,)
            specs[p + "self_attn.k_norm.weight"] = (d,)
        specs[p + "post_attention_layernorm.weight"] = (h,)
        specs[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        specs[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        specs[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    specs["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = (cfg.vocab_size, h)
    return specs


def init_weights(cfg: ModelConfig, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """Deterministic random weights: same seed, same bits (generated on CPU, then moved)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch_dtype(cfg.dtype)
    out = {}
    for name, shape in weight_specs(cfg).items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            # fan-in scaled, x2 for projections: a random model then emits varied tokens
            # instead of repeating one (tests of exactness need varied outputs)
            gain = 1.0 if name.endswith("embed_tokens.weight") else 2.0
            t = torch.randn(shape, generator=gen) * (gain * shape[1] ** -0.5)
        out[name] = t.to(device=device, dtype=dtype)
    return out


def load_safetensors_dir(path: str | Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Load every tensor the config needs from ``*.safetensors`` files in an HF model dir."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {path}")
    specs = weight_specs(cfg)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name in specs:
                    out[name] = fh.get_tensor(name)
    missing = [n for n in specs if n not in out]
    if missing:
        raise ConfigError(f"{path}: missing weights {missing[:3]} ({len(missing)} in all)")
    for name, t in out.items():
        if tuple(t.shape) != specs[name]:
            raise ConfigError(f"{name}: shape {tuple(t.shape)} != expected {specs[name]}")
    return out


def save_safetensors_dir(path: str | Path, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
    """Write an HF-layout model dir (config.json + model.safetensors)."""
    import json

    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(cfg.to_hf(), indent=1))
    save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(p / "model.safetensors"))
