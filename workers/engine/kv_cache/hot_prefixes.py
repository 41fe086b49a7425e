"""Which cached prefixes this worker's requests hit lately, and how much that is worth.

A scale-down uses it twice (issue 23): the replica whose cache is worth least goes first, and
the replica that goes hands its hottest prefixes to the survivors before it stops
(`router.hand_off`). A prefix's worth is the blocks its hits saved, decayed with a half-life:
a prefix hit often a while ago counts less than one hit as often just now. Never touches
tensors; scheduler thread.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence

from workers.contract.prefix_cache import HotPrefix

HALF_LIFE_S = 60.0
CAPACITY = 256  # prefixes remembered; the least worth is forgotten first


@dataclass
class _Entry:
    block_hashes: tuple[int, ...]
    token_ids: tuple[int, ...]
    worth: float  # hit blocks, decayed to `at`
    at: float  # seconds (the tracker's clock)


class HotPrefixes:
    """Decayed hit counts per prefix (keyed by its last block's hash) and in total."""

    def __init__(self, half_life_s: float = HALF_LIFE_S, capacity: int = CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if half_life_s <= 0 or capacity < 1:
            raise ValueError(f"half_life_s must be positive and capacity at least 1, got "
                             f"{half_life_s} and {capacity}")
        self.half_life_s = half_life_s
        self.capacity = capacity
        self.clock = clock
        self._entries: dict[int, _Entry] = {}
        self._total = 0.0
        self._total_at = clock()

    def _decayed(self, worth: float, at: float, now: float) -> float:
        return worth * math.exp2(-(now - at) / self.half_life_s)

    def record(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """A request found these leading blocks (of `token_ids`, the blocks' tokens) cached."""
        if not block_hashes:
            return
        now = self.clock()
        n = len(block_hashes)
        self._total = self._decayed(self._total, self._total_at, now) + n
        self._total_at = now
        leaf = block_hashes[-1]
        entry = self._entries.get(leaf)
        if entry is None:
            if len(self._entries) >= self.capacity:
                self._forget_least(now)
            self._entries[leaf] = _Entry(tuple(block_hashes), tuple(token_ids), n, now)
            return
        entry.worth = self._decayed(entry.worth, entry.at, now) + n
        entry.at = now

    def _forget_least(self, now: float) -> None:
        least = min(self._entries,
                    key=lambda h: self._decayed(self._entries[h].worth, self._entries[h].at, now))
        del self._entries[least]

    def recent_hit_blocks(self) -> float:
        """Blocks served from the cache lately (decayed): what this cache is worth now."""
        return self._decayed(self._total, self._total_at, self.clock())

    def top(self, max_blocks: int, cached: Callable[[int], bool]) -> list[HotPrefix]:
        """The most worth first, every block still `cached`, within `max_blocks` in all; a
        prefix that another chosen one extends is left out (pulling the longer brings it)."""
        now = self.clock()
        ranked = sorted(self._entries.values(),
                        key=lambda e: self._decayed(e.worth, e.at, now), reverse=True)
        chosen: list[_Entry] = []
        used = 0
        for e in ranked:
            if used + len(e.block_hashes) > max_blocks or not all(map(cached, e.block_hashes)):
                continue
            if any(_extends(c.block_hashes, e.block_hashes) for c in chosen):
                continue  # a chosen one already brings it
            shorter = [c for c in chosen if _extends(e.block_hashes, c.block_hashes)]
            chosen = [c for c in chosen if c not in shorter]
            used += len(e.block_hashes) - sum(len(c.block_hashes) for c in shorter)
            chosen.append(e)
        return [HotPrefix(e.block_hashes, e.token_ids, self._decayed(e.worth, e.at, now))
                for e in chosen]

    def clear(self) -> None:
        self._entries.clear()


def _extends(longer: tuple[int, ...], shorter: tuple[int, ...]) -> bool:
    return len(longer) >= len(shorter) and longer[:len(shorter)] == shorter
