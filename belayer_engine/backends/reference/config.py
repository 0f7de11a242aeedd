"""The reference worker's configuration, torch-free: ``belayer serve worker`` and ``python -m
belayer_engine.backends.reference.worker`` derive their flags from it."""

from __future__ import annotations

import argparse
import os

from pydantic import BaseModel, ConfigDict, Field

from belayer_core.config_flags import ConfigFlags


class WorkerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arena_socket: str = Field(description="control socket of the arena server")
    host: str = Field("127.0.0.1", description="bind address (loopback by default)")
    port: int = Field(30000, ge=0, le=65535, description="0 picks a free port")
    shadow: bool = Field(False, description="start as a pre-initialized shadow")
    worker_id: str = Field(default_factory=lambda: f"w-{os.getpid()}", description="name reported in /belayer/state")
    threads: int = Field(1, ge=1, description="torch intra-op threads (fixed: part of exact CPU numerics)")
    hang_timeout_s: float = Field(60.0, gt=0, description="/health fails once one scheduler step takes longer")
    max_running: int = Field(32, ge=1, description="requests decoded together")
    max_prefill_tokens: int = Field(1024, ge=1, description="prompt tokens admitted per scheduler step")
    max_queued: int = Field(256, ge=0, description=(
        "requests that may wait for a running slot; more: 429 (the router sends only what runs at once)"))
    tokenizer_dir: str | None = Field(None, description="dir with tokenizer.json")


FLAGS = ConfigFlags(WorkerConfig)


def add_flags(parser: argparse.ArgumentParser) -> None:
    FLAGS.add_to(parser)
