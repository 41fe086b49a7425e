"""Drafting methods: what proposes the next tokens of a request from its token history.

A `Drafter` is deterministic given the history (n-gram lookup), so the verification's rule is
"accept a drafted token when the target samples it", which leaves the output distribution
exactly the target's. Methods with draft probabilities (a draft model) add them to the
proposal (`workers.engine.speculative.rejection`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Drafter(Protocol):
    """Proposes up to `k` tokens to follow `token_ids` (prompt and output so far); [] when it
    has none. Must not keep references to `token_ids`."""

    name: str  # the method's name, as metrics label it

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        ...


class NgramDrafter:
    """Prompt lookup (vLLM's `ngram`): find the latest earlier occurrence of the history's last
    n tokens (n from `max_n` down to `min_n`) and copy the up-to-`k` tokens that followed it."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, "
                             f"{max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return self.lookup(token_ids, k)[0]

    def lookup(self, token_ids: Sequence[int], k: int) -> tuple[list[int], int]:
        """The draft and the length of the match it was copied after (0: none)."""
        length = len(token_ids)
        if k < 1 or length <= self.min_n:
            return [], 0
        tokens = np.asarray(token_ids, dtype=np.int64)
        # candidate starts i (< length - n): tokens[i:i + n] is followed by at least one token
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist(), n
        return [], 0
