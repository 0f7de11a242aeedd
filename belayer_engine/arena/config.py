"""The arena's configuration, torch-free: ``belayer serve arena`` and ``python -m
belayer_engine.arena`` derive their flags from it (``belayer_core.config_flags``)."""

from __future__ import annotations

import argparse
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from belayer_core.config_flags import ConfigFlags


class ArenaConfig(BaseModel):
    """Everything the arena needs; one flag per field on the command line."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    socket: str = Field(description="Unix socket path of the control channel")
    device: str = Field("cpu", description="cpu or cuda:N")
    model_dir: str | None = Field(None, description="HF-layout dir (config.json + *.safetensors); default: seeded weights")
    preset: Literal["small", "qwen3-4b"] = Field("small", description="shape of seeded weights when --model-dir is not given")
    seed: int = Field(0, description="seed of the generated weights")
    num_blocks: int = Field(256, ge=1, description="KV blocks in the live arena")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    scratch_blocks: int = Field(8, ge=0, description="KV blocks for shadows (0: backends whose KV lives in the worker)")
    ack_timeout_s: float = Field(30.0, gt=0, description="update_weights waits this long for every worker to switch")
    lease_wait_s: float = Field(2.0, gt=0, description="activation waits this long for the old worker's connection to close")
    reference_slots: bool = Field(True, description="hold the reference worker's two weight slots and KV arena; "
                                  "--no-reference-slots (needs an export that holds the weights, as the SGLang "
                                  "arena's --weight-cache-socket) keeps the weights once, in that export")

    cuda_stack_bytes: int = Field(256, ge=0, le=1 << 20, description=(
        "CUDA per-thread stack limit of the arena's context (the driver raises it for a kernel that "
        "needs more): 256 keeps ~200 MB of an H200's context free; 0 keeps the driver's 1 KiB"))


FLAGS = ConfigFlags(ArenaConfig)


def add_flags(parser: argparse.ArgumentParser) -> None:
    FLAGS.add_to(parser)
