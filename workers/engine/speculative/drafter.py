"""Drafting methods: what proposes the next tokens of a request from its token history.

A `Drafter` is deterministic given the history (n-gram lookup), so the verification's rule is
"accept a drafted token when the target samples it", which leaves the output distribution
exactly the target's. Methods with draft probabilities (a draft model) add them to the
proposal (`workers.engine.speculative.rejection`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np


class Drafter(Protocol):
    """Proposes up to `k` tokens to follow `token_ids` (prompt and output so far); [] when it
    has none. Must not keep references to `token_ids`."""

    name: str  # the method's name, as metrics label it

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        ...


class Lookup(NamedTuple):
    """A prompt lookup's draft, the length of the match it was copied after (0: none) and where
    in the history it was copied from."""

    draft: list[int]
    match: int
    start: int


class NgramDrafter:
    """Prompt lookup (vLLM's `ngram`): find an earlier occurrence of the history's last n
    tokens (n from `max_n` down to `min_n`) and copy the up-to-`k` tokens that followed it: the
    latest occurrence, or, given where the request's copying had reached (`after`), the first
    occurrence from there on: a text being copied or edited follows its source in order, and
    where the source repeats a phrase (`def mean` ... `def variance`) the latest occurrence is
    often the one already copied."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, "
                             f"{max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return self.lookup(token_ids, k).draft

    def lookup(self, token_ids: Sequence[int], k: int, after: int | None = None) -> Lookup:
        """The draft of up to `k` tokens, copied after the first occurrence of the longest match
        that continues at `after` or later, else after its latest occurrence."""
        length = len(token_ids)
        if k < 1 or length <= self.min_n:
            return Lookup([], 0, 0)
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
            return Lookup([], 0, 0)
        onward = ends[ends + 1 >= after] if after is not None else ends[:0]
        start = int(onward[0] if onward.size else ends[-1]) + 1
        return Lookup(tokens[start:start + k].tolist(), n, start)
