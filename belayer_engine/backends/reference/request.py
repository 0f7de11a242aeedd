"""A generation in flight and the KV blocks it reserves: what the scheduler keeps per request."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from belayer_engine.backends.reference.sampling import SamplingParams


@dataclass(eq=False)
class Request:
    """A generation in flight. ``emit`` is called from the engine thread with each update."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[dict], None]
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    version_start: int | None = None
    generator: torch.Generator | None = None
    created: float = field(default_factory=time.time)
    # SGLang's return_logprob / top_logprobs_num: None when not asked (no work per step)
    logprobs: list[float] | None = None
    top_logprobs_num: int = 0
    top_logprobs: list[list[tuple[float, int]]] | None = None
    logprob_texts: dict[int, str] | None = None  # the worker's decode cache (return_text_in_logprobs)


class BlockAllocator:
    """Free list of KV block ids. Metadata only: flushing it is the 'logical KV flush'."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))

    def reset(self) -> None:
        self.free = list(range(self.num_blocks - 1, -1, -1))
