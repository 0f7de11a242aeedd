"""Router configuration: one small pydantic model, validated once at start-up."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from belayer_core.errors import ConfigError

API_KEY_ENV = "BELAYER_API_KEY"


def read_key_file(path: str) -> str:
    """The key in ``path`` (first line); refused when the file is readable by others."""
    try:
        st = os.stat(path)
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"api_key_file {path!r}: {exc.strerror}") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"api_key_file {path!r} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise ConfigError(f"api_key_file {path!r} is empty")
    return key


class RouterConfig(BaseModel):
    """How the OpenAI-compatible router listens, recovers and waits.

    ``recovery="token"`` resumes from every streamed token (nothing is regenerated);
    ``recovery="chunk"`` mimics the coarser scheme of the reference paper: the preserved
    prefix only advances every ``chunk_tokens`` tokens, the rest is regenerated (and checked
    against what the client already received, never sent twice). ``recovery="replay"``
    re-sends the prompt alone and has the new worker decode the generated ids again, forced
    (SGLang workers with ``--enable-custom-logit-processor``): one decode step per generated
    id, and with SGLang's ``--enable-deterministic-inference`` the fault-free ids on a GPU.

    The API key (every route but the bare ``/health`` needs it when set) comes from
    ``api_key``, else ``api_key_file`` (a 0600 file), else the ``BELAYER_API_KEY``
    environment variable: the last two keep it off the command line (``ps``).
    """

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    api_key: str | None = Field(default=None, repr=False, description=(
        "clients must send it as a Bearer token; on the command line it shows in ps: prefer "
        "api_key_file or the BELAYER_API_KEY environment variable"))
    api_key_file: str | None = Field(default=None, description="a 0600 file holding the API key")
    worker_api_key: str | None = Field(default=None, repr=False, description=(
        "sent as 'Authorization: Bearer' to workers (the engine's per-engine secret; "
        "SGLang's --api-key for static workers)"))
    worker_api_key_file: str | None = Field(default=None, description=(
        "a 0600 file holding worker_api_key (e.g. for SGLang servers started with --api-key)"))
    model_name: str = "belayer-default"
    recovery: Literal["token", "chunk", "replay"] = "token"
    chunk_tokens: int = Field(default=256, ge=1)
    stall_timeout_s: float = Field(default=10.0, gt=0, description="no token for this long: probe the worker")
    stall_probe_timeout_s: float = Field(default=2.0, gt=0, description="no /health answer within this = stalled")
    max_silence_s: float = Field(default=300.0, gt=0, description="give up on a healthy but silent worker")
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_wait_s: float = Field(default=120.0, gt=0, description="how long a request waits for a healthy worker")
    max_recoveries: int = Field(default=16, ge=0, description="per request, then the client gets an error")
    max_waiting_generations: int = Field(default=16384, ge=1, description=(
        "generations that may wait in the router for a worker with room (each worker is sent only what it "
        "runs at once); a request that would make more wait: 429"))
    default_max_tokens: int = Field(default=256, ge=1)
    tokenizer: str | None = Field(default=None, description="model dir with tokenizer.json; None = embedded byte tokenizer")
    vocab_size: int | None = Field(default=None, ge=1, description=(
        "prompt token ids at or above this are refused (400): an SGLang server indexes its embedding "
        "with them and dies, then its replacement does; None: the tokenizer dir's config.json says, "
        "else not checked"))
    probe_interval_s: float = Field(default=1.0, gt=0, description="health probing of workers without a supervisor")

    @model_validator(mode="after")
    def _resolve_key(self) -> RouterConfig:
        if self.api_key is None and self.api_key_file is not None:
            self.api_key = read_key_file(self.api_key_file)
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key is empty")
        if self.worker_api_key is None and self.worker_api_key_file is not None:
            self.worker_api_key = read_key_file(self.worker_api_key_file)
        return self
