"""How large an SGLang server's KV pool, context and batch are, read from the model's
``config.json`` and the device (torch-free): the engine's defaults, and what ``--kv-*``
options turn into SGLang flags."""

from __future__ import annotations

import json
from pathlib import Path

from belayer_core.errors import ConfigError


def is_cpu(device: str) -> bool:
    return device == "cpu"


def flag_value(extra_args: list[str], names: tuple[str, ...]) -> str | None:
    """The value ``extra_args`` give the SGLang flag spelled ``names`` (the last one wins, as
    in SGLang's argparse); None when none does."""
    found = None
    for i, arg in enumerate(extra_args):
        name, eq, value = arg.partition("=")
        if name in names:
            found = value if eq else (extra_args[i + 1] if i + 1 < len(extra_args) else "")
    return found


RESERVE_MIN, RESERVE_MAX = 512, 4096
DEFAULT_GPU_KV_FRACTION = 0.8  # of the device's memory, for the arena's weights + KV pool (like SGLang's static share)
CPU_KV_TOKENS = 4096  # CPU servers (tests, CI): a small pool
CPU_CONTEXT, CPU_RUNNING, GPU_RUNNING = 2048, 16, 64  # --context-length, --max-running-requests defaults
MAX_DEFAULT_CONTEXT = 65536


def kv_plan(tokens: int | None, reserve: int | None, extra_args: list[str], model_path: str | None = None,
            device: str = "cpu", fraction: float | None = None) -> tuple[int, int]:
    """The KV pool's size in tokens (every server's ``--max-total-tokens``) and the reserve
    beside it (``kv_pool.py``). ``tokens``: given, else ``--max-total-tokens`` in
    ``extra_args``, else on a GPU what ``fraction`` (default 0.8) of the device's memory holds
    after the weights, on CPU 4,096. ``reserve``: given, else 1/64 of the pool within [512,
    4,096]: room for the promoted shadow's first allocations (a token per adopted request, then
    decoding) until the dead server is reaped (~0.5-1.5 s on a GPU)."""
    if tokens is None:
        flag = flag_value(extra_args, ("--max-total-tokens",))
        if flag and flag.isdigit():
            tokens = int(flag)
        elif is_cpu(device) or model_path is None:
            tokens = CPU_KV_TOKENS
        else:
            tokens = kv_tokens_for_fraction(model_path, device, fraction or DEFAULT_GPU_KV_FRACTION)
    if tokens < 64:
        raise ConfigError(f"sglang_kv_tokens={tokens}: a KV pool needs at least 64 tokens")
    if reserve is None:
        reserve = min(RESERVE_MAX, max(RESERVE_MIN, tokens // 64))
    if reserve < 1:
        raise ConfigError(f"sglang_kv_reserve_tokens={reserve}: must be at least 1")
    return tokens, reserve


def kv_bytes_per_token(model_path: str) -> int | None:
    """Bytes of K and V per token: layers x 2 x KV heads x head dim x the checkpoint dtype's
    width (SGLang's KV dtype follows the model's); None when config.json does not say."""
    config = _hf_config(model_path)
    try:
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        layers = config["num_hidden_layers"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return layers * 2 * heads * head_dim * (4 if _dtype(config) == "float32" else 2)


def device_total_mib(device: str) -> int | None:
    """Total memory of CUDA device ``device`` (nvidia-smi); None when it cannot be read."""
    import subprocess

    index = device.split(":", 1)[1] if ":" in device else "0"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", index],
                             capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip().splitlines()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def kv_tokens_for_fraction(model_path: str, device: str, fraction: float) -> int:
    """Tokens of KV that fit in ``fraction`` of the device's memory beside the weights."""
    if not 0 < fraction < 1:
        raise ConfigError(f"sglang_kv_fraction={fraction}: must be between 0 and 1")
    per_token, total = kv_bytes_per_token(model_path), device_total_mib(device)
    weights = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    if per_token is None or total is None:
        raise ConfigError(f"cannot size the KV pool for {device} (device memory or {model_path}/config.json "
                          "unreadable): give sglang_kv_tokens")
    tokens = int((fraction * total * 2**20 - weights) // per_token)
    if tokens < 64:
        raise ConfigError(f"sglang_kv_fraction={fraction} of {total} MiB leaves no room for KV beside "
                          f"{weights / 2**20:.0f} MiB of weights: raise it or give sglang_kv_tokens")
    return tokens


def context_default(model_path: str | None, device: str) -> int:
    """The servers' --context-length when none is given: the model's own on a GPU (capped at
    65,536), 2,048 on CPU."""
    if is_cpu(device) or model_path is None:
        return CPU_CONTEXT
    own = _hf_config(model_path).get("max_position_embeddings")
    return min(int(own), MAX_DEFAULT_CONTEXT) if isinstance(own, int) and own > 0 else 32768


def kv_pool_mib(model_path: str, extra_args: list[str]) -> float | None:
    """MiB of the KV pool a server of ``model_path`` allocates: ``max_total_tokens`` (the
    launcher's, or ``--max-total-tokens`` in ``extra_args``) x layers x 2 x KV heads x head
    dim x the checkpoint dtype's bytes; None when config.json does not say."""
    tokens = flag_value(extra_args, ("--max-total-tokens",))
    tokens = int(tokens) if tokens and tokens.isdigit() else CPU_KV_TOKENS
    per_token = kv_bytes_per_token(model_path)
    return None if per_token is None else tokens * per_token / 2**20


def checkpoint_dtype(model_path: str) -> str | None:
    """``torch_dtype`` (or ``dtype``) of an HF model dir's config.json; None when absent."""
    return _dtype(_hf_config(model_path))


def _hf_config(model_path: str) -> dict:
    """An HF model dir's config.json ({} when absent or not a JSON object)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _dtype(config: dict) -> str | None:
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype if isinstance(dtype, str) else None


