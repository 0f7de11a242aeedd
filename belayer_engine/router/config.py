"""Router configuration: one small pydantic model, validated once at start-up."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class RouterConfig(BaseModel):
    """How the OpenAI-compatible router listens, recovers and waits.

    ``recovery="token"`` resumes from every streamed token (nothing is regenerated);
    ``recovery="chunk"`` mimics the coarser scheme of the reference paper: the preserved
    prefix only advances every ``chunk_tokens`` tokens, the rest is regenerated (and checked
    against what the client already received, never sent twice).
    """

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    api_key: str | None = None
    model_name: str = "belayer-default"
    recovery: Literal["token", "chunk"] = "token"
    chunk_tokens: int = Field(default=256, ge=1)
    stall_timeout_s: float = Field(default=10.0, gt=0, description="no token for this long: probe the worker")
    stall_probe_timeout_s: float = Field(default=2.0, gt=0, description="no /health answer within this = stalled")
    max_silence_s: float = Field(default=300.0, gt=0, description="give up on a healthy but silent worker")
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_wait_s: float = Field(default=120.0, gt=0, description="how long a request waits for a healthy worker")
    max_recoveries: int = Field(default=16, ge=0, description="per request, then the client gets an error")
    default_max_tokens: int = Field(default=256, ge=1)
    tokenizer: str | None = Field(default=None, description="model dir with tokenizer.json; None = embedded byte tokenizer")
    probe_interval_s: float = Field(default=1.0, gt=0, description="health probing of workers without a supervisor")
