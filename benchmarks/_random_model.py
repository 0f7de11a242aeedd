"""A model of a chosen shape with random weights, written as an HF-layout safetensors
directory: what the engine benchmarks load (``--small``: the embedded small model, else the
Qwen3-4B shape in bf16, generated on the device)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def sync(device) -> None:
    """Wait for the device's queued work (CUDA), so a time taken after it is the work's."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def random_model_dir(path: Path, small: bool, device: str) -> None:
    """Random weights of the chosen shape, written as an HF-layout safetensors dir."""
    import torch

    from belayer_engine.model.config import ModelConfig
    from belayer_engine.model.weights import init_weights, save_safetensors_dir, weight_specs

    cfg = ModelConfig() if small else ModelConfig.qwen3_4b()
    if small:
        weights = init_weights(cfg, 0)
    else:  # generate on the device: 4.4 B params on CPU would dominate the run
        gen = torch.Generator(device=device).manual_seed(0)
        weights = {}
        for name, shape in weight_specs(cfg).items():
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            t = 1.0 + 0.1 * t if len(shape) == 1 else t * (shape[-1] ** -0.5)
            weights[name] = t.to(torch.bfloat16)
    save_safetensors_dir(path, cfg, weights)


def prepared(workdir: str | None, small: bool, device: str) -> Path:
    """``<workdir>/model`` (a fresh temporary directory when None), written unless it is there."""
    work = Path(workdir or tempfile.mkdtemp(prefix="belayer-bench-"))
    model_dir = work / "model"
    t = time.time()
    if not (model_dir / "config.json").exists():
        random_model_dir(model_dir, small, device)
    print(f"model dir ready in {time.time() - t:.1f}s", flush=True)
    return model_dir
