"""The host-memory tier of the prefix cache: full blocks evicted from the primary pool keep
their KV in a bounded host pool, and a later prefix hit copies them back instead of recomputing.

Bookkeeping only, like the block pool: which host block holds which hash, in LRU order, and the
copies the next step must make before its forward pass (`take_copies`):

- `swap_out` (device block -> host block): a cached device block is being reused; its KV is
  saved first. A hash already in the host tier is not copied again (the tier is inclusive: a
  block brought back stays in host memory too, so evicting it again costs nothing).
- `swap_in` (host block -> device block): a prefix hit in host memory, into a fresh device block.

Saves run before loads: a device block saved and reallocated in the same step may be a load's
target. A host block a pending load reads is never reused for a save in the same step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from workers.engine.kv_cache.events import KVEventLog
from workers.contract.prefix_cache import HOST


class BlockCopies(NamedTuple):
    """One step's copies between the tiers: (source block, destination block) pairs."""

    swap_out: tuple[tuple[int, int], ...] = ()  # (device block, host block), run first
    swap_in: tuple[tuple[int, int], ...] = ()  # (host block, device block)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in)


NO_COPIES = BlockCopies()


class HostTier:
    """`num_blocks` host blocks, each holding one cached hash's KV, least recently used first."""

    def __init__(self, num_blocks: int, events: KVEventLog) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.events = events
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # hash -> host block, LRU first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._reading: set[int] = set()  # host blocks a pending load reads
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        # counters since start (metrics, tests, the router's cost of a host hit)
        self.num_saved = 0
        self.num_loaded = 0
        self.num_dropped = 0  # evictions not saved: every host block was being read

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def cached_hashes(self) -> list[int]:
        return list(self._by_hash)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def save(self, block_hash: int, device_block: int) -> None:
        """A cached device block is being reused: keep its KV here (evicting the least recently
        used host block when full). Its hash stays findable."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return
        host_block = self._take_block()
        if host_block is None:
            self.num_dropped += 1
            return
        self._by_hash[block_hash] = host_block
        self._swap_out.append((device_block, host_block))
        self.num_saved += 1
        self.events.stored([block_hash], None, [], medium=HOST)

    def _take_block(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, host_block in self._by_hash.items():  # LRU first
            if host_block not in self._reading:
                del self._by_hash[block_hash]
                self.events.removed([block_hash], medium=HOST)
                return host_block
        return None

    def protect(self, block_hashes: list[int]) -> None:
        """Keep these hits' host blocks from being reused by saves until the step's copies are
        taken (call before allocating the device blocks they load into)."""
        for block_hash in block_hashes:
            self._by_hash.move_to_end(block_hash)
            self._reading.add(self._by_hash[block_hash])

    def load(self, block_hash: int, device_block: int) -> None:
        """Bring a host hit back into `device_block` before the next forward pass."""
        host_block = self._by_hash[block_hash]
        self._by_hash.move_to_end(block_hash)
        self._reading.add(host_block)
        self._swap_in.append((host_block, device_block))
        self.num_loaded += 1

    def take_copies(self) -> BlockCopies:
        """The copies the next step makes (saves first), and forget them."""
        if not (self._swap_out or self._swap_in):
            return NO_COPIES
        copies = BlockCopies(tuple(self._swap_out), tuple(self._swap_in))
        self._swap_out, self._swap_in = [], []
        self._reading.clear()
        return copies

    def clear(self) -> None:
        """Forget every hash (a prefix-cache reset). Pending copies are dropped too."""
        self._by_hash.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._reading.clear()
        self._swap_out, self._swap_in = [], []

