"""The export/lease ledger: blocks held under an id, apart from any running request."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from workers.engine.kv_cache.block_pool import BlockPool, KVBlock


class LeaseLedger:
    """Blocks held for another worker (or from one), each hold under an id, until it ends.

    A hold is one of: a finished prefill-only request's blocks (`keep`, its KV handoff reads
    them), the cached blocks of a prefix offered to another worker (`hold_prefix`), fresh blocks
    reserved for a pull to fill (`reserve`), or a running request's leading blocks offered to a
    live migration's target (`KVCacheManager.hold_leading`).

    Contract: each hold owns one reference on each of its blocks, and exactly one of these ends
    it: `free_held` (releases them, tail first), `cache_reserved` (a reserved hold's blocks join
    the prefix cache, then are released), `take` (the references pass to the caller: a request
    adopts them). Hold ids are made by the server (a request's id, or one derived from it) and
    never collide with a request holding blocks in the `KVCacheManager` (`in_use`). Never
    touches tensors; callers on the engine's step thread, between steps.
    """

    def __init__(self, pool: BlockPool, in_use: Callable[[str], bool]) -> None:
        """`in_use(id)`: whether a request holds blocks under that id (a new hold may not)."""
        self.pool = pool
        self._in_use = in_use
        self._held: dict[str, list[KVBlock]] = {}  # hold id -> its blocks, in token order

    @property
    def num_held(self) -> int:
        """Holds not yet ended (0 when nothing is offered, reserved or leaked)."""
        return len(self._held)

    def check_new(self, hold_id: str) -> None:
        """Raise `ValueError` when `hold_id` already holds blocks here (held or running)."""
        if hold_id in self._held or self._in_use(hold_id):
            raise ValueError(f"{hold_id!r} already holds blocks here")

    def keep(self, hold_id: str, blocks: list[KVBlock]) -> None:
        """Hold `blocks`, their references passing to the hold (a finished request's, which no
        longer holds them)."""
        self._held[hold_id] = blocks

    def share(self, hold_id: str, blocks: list[KVBlock]) -> list[int]:
        """Hold `blocks` someone else holds too (one more reference each) under a new
        `hold_id`; their ids. Nothing is held for no blocks."""
        self.check_new(hold_id)
        if blocks:
            self.pool.touch(blocks)
            self._held[hold_id] = blocks
        return [b.block_id for b in blocks]

    def hold_prefix(self, hold_id: str, block_hashes: Sequence[int]) -> list[int]:
        """Hold the device blocks of the leading `block_hashes` found in the prefix cache (up
        to the first miss) for another worker to pull, until `free_held(hold_id)`; their ids in
        token order ([] when the first is not cached, and nothing is held)."""
        blocks: list[KVBlock] = []
        for block_hash in block_hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return self.share(hold_id, blocks)

    def reserve(self, hold_id: str, num_blocks: int) -> list[int] | None:
        """Hold `num_blocks` fresh blocks for a pull to fill (what they evict is not saved to
        the host tier: the pull writes them first), until `cache_reserved`, `take` or
        `free_held`. None, and nothing held, when that many are not free."""
        self.check_new(hold_id)
        if num_blocks > self.pool.num_free_blocks:
            return None
        blocks = self.pool.allocate(num_blocks, save_evicted=False)
        self._held[hold_id] = blocks
        return [b.block_id for b in blocks]

    def cache_reserved(self, hold_id: str, block_hashes: Sequence[int],
                       token_ids: Sequence[int]) -> None:
        """The reserved blocks hold the KV of the prompt's leading `block_hashes` (of
        `token_ids`): they enter the prefix cache and are released, free but findable, so the
        request that follows finds them as hits."""
        blocks = self._held.pop(hold_id)
        if len(block_hashes) != len(blocks):
            raise ValueError(f"{hold_id!r}: {len(block_hashes)} hashes for {len(blocks)} "
                             "reserved blocks")
        self.pool.cache(blocks, list(block_hashes), None, list(token_ids))
        self.pool.release(blocks[::-1])

    def take(self, hold_id: str) -> list[KVBlock]:
        """End a hold, its references passing to the caller ([] when none is held)."""
        return self._held.pop(hold_id, [])

    def held_block_ids(self, hold_id: str) -> list[int]:
        """The blocks held under `hold_id`, in token order; [] when none are held."""
        return [b.block_id for b in self._held.get(hold_id, ())]

    def free_held(self, hold_id: str) -> bool:
        """Release the blocks held under `hold_id`; False (harmless) when none are held."""
        blocks = self._held.pop(hold_id, None)
        if blocks is None:
            return False
        self.pool.release(blocks[::-1])
        return True
