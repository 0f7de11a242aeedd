"""Supervisor configuration: what to start, and how quickly to declare things dead."""

from __future__ import annotations

import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SupervisorConfig(BaseModel):
    """One slot per worker; each slot has its own arena (device) and, optionally, a shadow."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    backend: Literal["reference", "sglang"] = Field(default="reference", description="kind of inference worker")
    sglang_venv: str | None = Field(default=None, description="SGLang venv (sglang backend); None = $BELAYER_SGLANG_VENV or /opt/belayer/sglang-venv")
    sglang_shadow_memory_saver: bool | None = Field(
        default=None, description="sglang backend: shadows release their KV cache until promoted "
                                  "(GPU, torch_memory_saver); None = where available, for a KV pool over 768 MiB, "
                                  "and torch's expandable segments not turned on in the environment")
    sglang_shadow_release_graphs: bool | None = Field(
        default=None, description="sglang backend, with the memory saver: shadows release their decode CUDA "
                                  "graphs too (~0.1 GB less while idle for a 4B model; promotion resumes them)")
    sglang_cuda_stack_bytes: int | None = Field(
        default=None, ge=0, description="sglang backend on a GPU: each server's CUDA per-thread stack limit, set "
                                        "as its scheduler picks its device (the driver raises it for any kernel "
                                        "that needs more); None = the backend's default (256), 0 = the driver's "
                                        "(1 KiB)")

    sglang_kv: Literal["arena", "server"] | None = Field(
        default=None, description="sglang backend: where the KV pool lives. 'arena' (None: the default at "
                                  "--tp-size 1): in the slot's arena, mapped by worker and shadow; the shadow adopts "
                                  "the dead worker's in-flight requests with their KV (no re-prefill). 'server' "
                                  "(None at --tp-size > 1): in each SGLang server")
    sglang_kv_tokens: int | None = Field(
        default=None, ge=64, description="sglang backend: the KV pool in tokens (SGLang's --max-total-tokens); None = "
                                         "--max-total-tokens in worker_args, else on a GPU what sglang_kv_fraction "
                                         "holds, on CPU 4,096")
    sglang_kv_fraction: float | None = Field(
        default=None, gt=0, lt=1, description="sglang backend on a GPU, without sglang_kv_tokens: the share of the "
                                               "device's memory for the weights and the KV pool (None = 0.8); the "
                                               "rest holds the worker's and shadow's own memory")
    sglang_kv_reserve_tokens: int | None = Field(
        default=None, ge=1, description="sglang backend, sglang_kv='arena': pool slots the serving worker never "
                                        "takes (its shadow's; the promoted shadow's until the dead worker is reaped); "
                                        "None = 1/64 of the pool within [512, 4,096]")

    workers: int = Field(default=1, ge=1)
    shadow: bool = True
    device: str = Field(default="cpu", description="'cpu', 'cuda' (slot i -> cuda:i) or 'cuda:N'")
    model: str | None = Field(default=None, description="local HF-layout model dir; None = embedded small model")
    arena_args: list[str] = Field(default_factory=list, description="extra arena options")
    worker_args: list[str] = Field(default_factory=list, description="extra worker options")
    host: str = "127.0.0.1"
    python: str = sys.executable
    run_dir: str | None = Field(default=None, description="logs + sockets; None = a temporary directory")
    weights_socket: str | None = Field(
        default=None, description="Unix socket (0600) of the engine's weight endpoint for learners in other "
                                  "processes; None = RUN_DIR/weights.sock")
    start_timeout_s: float = Field(
        default=600.0, gt=0, description="a process not ready after this fails the start; a first SGLang start on a "
                                         "fresh GPU machine took 147 s (kernel builds), a CPU one ~60-120 s; a wait "
                                         "longer than 15 s logs its progress")
    fence_timeout_s: float = Field(default=10.0, gt=0)
    unhealthy_window_s: float = Field(default=10.0, ge=0, description="a replacement failing within this = bad device")
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=5.0, gt=0)
    health_failures: int = Field(default=3, ge=1, description="consecutive failed probes that count as a stall")

    @model_validator(mode="after")
    def _sglang_options_need_sglang(self) -> SupervisorConfig:
        if self.backend != "sglang":
            given = [name for name in ("sglang_venv", "sglang_shadow_memory_saver", "sglang_shadow_release_graphs",
                                       "sglang_cuda_stack_bytes", "sglang_kv", "sglang_kv_tokens",
                                       "sglang_kv_reserve_tokens", "sglang_kv_fraction")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to backend='sglang' (backend is {self.backend!r})")
        return self

    def device_of(self, slot_index: int) -> str:
        if self.device == "cuda":
            return f"cuda:{slot_index}"
        return self.device


def make_backend(config: SupervisorConfig):
    """The ``WorkerBackend`` that ``config.backend`` names."""
    if config.backend == "sglang":
        from belayer_engine.backends.sglang.backend import SGLangBackend

        return SGLangBackend(config.model, config.worker_args, config.sglang_venv, device=config.device,
                             shadow_memory_saver=config.sglang_shadow_memory_saver,
                             shadow_release_graphs=bool(config.sglang_shadow_release_graphs),
                             cuda_stack_bytes=config.sglang_cuda_stack_bytes, kv=config.sglang_kv,
                             kv_tokens=config.sglang_kv_tokens, kv_reserve_tokens=config.sglang_kv_reserve_tokens,
                             kv_fraction=config.sglang_kv_fraction)
    from belayer_engine.backends.reference.launcher import ReferenceBackend

    return ReferenceBackend(config.worker_args)
