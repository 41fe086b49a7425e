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
        # ends j (< length - 1) of earlier occurrences of the last token, then of the last
        # n + 1 tokens for as long as any survive: one pass, n growing, the candidates shrinking
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        n, cap = 1, min(self.max_n, length - 1)
        while ends.size and n < cap:
            reach = ends[ends >= n]  # an occurrence of n + 1 tokens ends at n or later
            longer = reach[tokens[reach - n] == tokens[length - 1 - n]]
            if not longer.size:
                break
            ends, n = longer, n + 1
        if not ends.size or n < self.min_n:
            return [], 0
        start = int(ends[-1]) + 1
        return tokens[start:start + k].tolist(), n
