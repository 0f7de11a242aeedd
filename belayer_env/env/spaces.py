"""A Gymnasium text space that admits any string (commands and their outputs).

Gymnasium's ``Text`` only contains strings over its charset (alphanumerics by default), so
a shell command with a space, or an output with a newline, would be "outside" the space.
Listing all of Unicode as the charset would cost ~100 MB per space; instead ``AnyText``
admits every ``str`` up to ``max_length`` and samples short alphanumeric strings (enough
for ``check_env``; an agent never samples its actions from the space).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.spaces import Text


class AnyText(Text):
    def __init__(self, max_length: int, *, sample_max_length: int = 16,
                 seed: int | np.random.Generator | None = None):
        super().__init__(max_length=max_length, min_length=0, seed=seed)
        self.sample_max_length = min(sample_max_length, max_length)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is None and probability is None:
            length = int(self.np_random.integers(1, self.sample_max_length + 1))
            return super().sample(mask=(length, None))
        return super().sample(mask=mask, probability=probability)

    def __repr__(self) -> str:
        return f"AnyText(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AnyText) and other.max_length == self.max_length

    __hash__ = None  # type: ignore[assignment]  # mutable rng, like Gymnasium's spaces
