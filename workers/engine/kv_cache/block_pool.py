"""A pool of fixed-size KV blocks with reference counts, a free list and the prefix-cache map."""

from __future__ import annotations

from collections import OrderedDict

from workers.engine.kv_cache.events import KVEventLog
from workers.engine.kv_cache.host_tier import HostTier


class KVBlock:
    """One block of `block_size` token slots. `block_hash` is set once the block is full and
    cached."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Hands out blocks; keeps freed full blocks findable by hash until they are reused.

    Free blocks sit in `_free` in eviction order (least recently freed first). A free block with a
    hash is still a prefix-cache entry: `touch` revives it; `allocate` evicts it (and says so in
    the event log) only when it is reused, first saving it to the host tier when there is one.
    """

    def __init__(self, num_blocks: int, events: KVEventLog, enable_caching: bool = True,
                 host: HostTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}
        self.host = host

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int, save_evicted: bool = True) -> list[KVBlock]:
        """Take `n` free blocks (ref count 1 each), evicting their old cache entries: saved to
        the host tier, unless `save_evicted` is False (blocks written before the next step,
        which the save would then copy too late: a KV handoff's)."""
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out: list[KVBlock] = []
        evicted: list[int] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                if self.host is not None and save_evicted:
                    self.host.save(block.block_hash, block.block_id)
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        self.events.removed(evicted)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block (prefix hits); revives free cached blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block. Pass a request's blocks tail first, so its last
        blocks (the least shareable) are the first evicted."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # uncached blocks go to the front: reuse them before evicting cache entries
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._free[block.block_id] = block

    def cache(self, blocks: list[KVBlock], hashes: list[int], parent: int | None,
              token_ids: list[int]) -> None:
        """Register full blocks under their chained hashes; a hash already present keeps its
        first block (the duplicate stays private to its request)."""
        if not self.enable_caching:
            return
        stored: list[int] = []
        stored_tokens: list[int] = []
        size = self.events.block_size
        for i, (block, block_hash) in enumerate(zip(blocks, hashes)):
            if block.block_hash is not None or block_hash in self._cached:
                if stored:  # keep each BlockStored event one unbroken chain
                    self.events.stored(stored, parent, stored_tokens)
                    stored, stored_tokens = [], []
                parent = block_hash
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            stored.append(block_hash)
            stored_tokens.extend(token_ids[i * size:(i + 1) * size])
        self.events.stored(stored, parent, stored_tokens)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.host is not None:
            self.host.clear()
        self.events.cleared()
        return True
