"""Per-request block tables on top of the block pool, with prefix-cache lookups."""

from __future__ import annotations

from typing import NamedTuple, TypeGuard

from workers.engine.kv_cache.block_pool import BlockPool, KVBlock
from workers.engine.kv_cache.events import KVEventLog
from workers.engine.kv_cache.host_tier import NO_COPIES, BlockCopies, HostTier
from workers.engine.kv_cache.hot_prefixes import HotPrefixes
from workers.engine.kv_cache.ledger import LeaseLedger
from workers.contract.prefix_cache import hash_block
from workers.engine.request import Request


class HostHit(NamedTuple):
    """A prefix hit in the host tier: the block's KV is copied into a fresh device block."""

    block_hash: int


class KVCacheManager:
    """Owns which blocks each request holds. Never touches tensors.

    Contract: `allocate_slots` either gives a request room for its next tokens or changes
    nothing; `free` returns every block the request holds; `cache_blocks` registers the
    request's newly computed full blocks in the prefix cache.

    `window`: set when every layer attends over a sliding window of that many tokens (Mistral).
    Then `allocate_slots` first returns (cached: they stay hits) the blocks no later query can
    see, except of requests held for a KV handoff. Their table entries repeat the first live
    block's id: attention never reads them (the kernels start at the window; torch masks).

    `host_blocks`: the size of the host-memory tier (`workers.engine.kv_cache.host_tier`; 0: none).
    Prefix hits there are brought back by copies the runner makes before the step's forward
    pass (`take_copies`). `hot`: the prefixes hit lately, and what they saved. `ledger`: blocks
    held apart from running requests (`workers.engine.kv_cache.ledger`); `hold`, `hold_leading`
    and `adopt` move blocks between a request and the ledger.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 window: int | None = None, host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.window = window
        self.enable_caching = enable_caching
        self.events = KVEventLog(block_size, enabled=enable_caching)
        self.host = (HostTier(host_blocks, self.events)
                     if host_blocks > 0 and enable_caching else None)
        self.pool = BlockPool(num_blocks, self.events, enable_caching, self.host)
        self._blocks: dict[str, list[KVBlock | None]] = {}  # None: out of the window, returned
        # each request's block ids, in token order: rebuilt only when its blocks change, so the
        # scheduler hands the same tuple to every step in between
        self._tables: dict[str, tuple[int, ...]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already in the cache
        self._num_dropped: dict[str, int] = {}  # leading blocks returned, out of the window
        # blocks held apart from running requests (handoffs, exports, reserved pulls)
        self.ledger = LeaseLedger(self.pool, self.holds)
        self.hot = HotPrefixes()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's block ids in token order; the same object until its blocks change."""
        return self._tables.get(request_id, ())

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks

    def _extend_hashes(self, req: Request, num_full_blocks: int) -> None:
        hashes, size = req.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     req.all_token_ids[i * size:(i + 1) * size],
                                     req.cache_salt if i == 0 else None))

    def get_computed_blocks(self, req: Request) -> list[KVBlock | HostHit]:
        """The longest run of the request's leading full blocks found in the prefix cache: in
        the device pool (a `KVBlock`) or else in the host tier (a `HostHit`).

        Leaves at least one token to compute (its logits give the next token). Requests that
        want prompt logprobs compute everything. Takes no references.
        """
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._extend_hashes(req, max_blocks)
        hits: list[KVBlock | HostHit] = []
        host = self.host
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is not None:
                hits.append(block)
            elif host is not None and block_hash in host:
                hits.append(HostHit(block_hash))
            else:
                break
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: list[KVBlock | HostHit] | None = None, *,
                       save_evicted: bool = True) -> bool:
        """Make room for `num_new_tokens` after the request's computed tokens (and after the
        prefix hits `computed`: references on the device ones, fresh blocks the host ones are
        copied into). False, and no change, when the pool is short of blocks. `save_evicted`
        False: the cache entries evicted for room are dropped, not saved to the host tier (the
        caller writes the blocks before the next step: a KV handoff)."""
        self._drop_out_of_window(req)
        blocks = self._blocks.get(req.request_id, [])
        total = req.num_computed_tokens + num_new_tokens
        if blocks and not computed and total <= len(blocks) * self.block_size:
            return True  # fits the blocks it has (most decode steps)
        computed = computed or []
        on_device = [b for b in computed if isinstance(b, KVBlock)]
        total += len(computed) * self.block_size
        needed = self.num_blocks_for(total) - len(blocks) - len(on_device)
        revived = sum(1 for b in on_device if b.ref_cnt == 0)  # leave the free list when touched
        if max(needed, 0) > self.pool.num_free_blocks - revived:
            return False
        self.pool.touch(on_device)
        from_host = [h.block_hash for h in computed if isinstance(h, HostHit)]
        if from_host:
            self.host.protect(from_host)  # type: ignore[union-attr]  # the saves below keep them
        fresh = self.pool.allocate(needed, save_evicted) if needed > 0 else []
        blocks = self._blocks.setdefault(req.request_id, blocks)
        if computed:
            self._place_hits(req, blocks, computed, fresh[:len(from_host)])
            fresh = fresh[len(from_host):]
        blocks.extend(fresh)
        self._tables[req.request_id] = _table(blocks)
        return True

    def _place_hits(self, req: Request, blocks: list[KVBlock | None],
                    computed: list[KVBlock | HostHit], targets: list[KVBlock]) -> None:
        """Append the hits in token order; each host hit's KV is loaded into the next target,
        which enters the device cache at once (the load runs before any step reads it)."""
        targets_left = iter(targets)
        first = len(blocks)
        for hit in computed:
            if isinstance(hit, HostHit):
                block = next(targets_left)
                self.host.load(  # type: ignore[union-attr]  # a host hit implies a host tier
                    hit.block_hash, block.block_id)
                blocks.append(block)
            else:
                blocks.append(hit)
        if targets:
            placed: list[KVBlock] = blocks[first:]  # type: ignore[assignment]  # no None here
            self.pool.cache(placed, req.block_hashes[first:len(blocks)],
                            req.block_hashes[first - 1] if first else None,
                            req.all_token_ids[first * self.block_size:
                                              len(blocks) * self.block_size])
        self._num_cached_blocks[req.request_id] = n = len(blocks)
        self.hot.record(req.block_hashes[:n], req.all_token_ids[:n * self.block_size])

    def take_copies(self) -> BlockCopies:
        """The tier copies the next step must make before its forward pass (saves of evicted
        blocks, then loads of host hits); none without a host tier."""
        return self.host.take_copies() if self.host is not None else NO_COPIES

    def _drop_out_of_window(self, req: Request) -> None:
        """Return the request's blocks wholly before its next query's window (see the class)."""
        blocks = self._blocks.get(req.request_id)
        if self.window is None or req.hold_kv or not blocks:
            return
        first_seen = req.num_computed_tokens - self.window + 1  # the next query's first key
        dead = min(max(first_seen, 0) // self.block_size, len(blocks))
        done = self._num_dropped.get(req.request_id, 0)
        if dead <= done:  # most steps: nothing new left the window
            return
        # cached first (blocks pulled from another worker are not yet): they stay hits
        self.cache_blocks(req)
        dropped = blocks[done:dead]
        blocks[done:dead] = [None] * (dead - done)
        self._num_dropped[req.request_id] = dead
        self.pool.release([b for b in dropped[::-1] if b is not None])
        self._tables[req.request_id] = _table(blocks)

    def cache_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks that are not in the cache yet."""
        if not self.enable_caching:
            return
        rid = req.request_id
        done = self._num_cached_blocks.get(rid, 0)
        full = min(req.num_computed_tokens // self.block_size, len(self._blocks.get(rid, ())))
        if full <= done:
            return
        self._extend_hashes(req, full)
        size = self.block_size
        blocks = self._blocks[rid][done:full]
        if not _whole(blocks):  # a block is cached before it leaves the window: never reached
            raise RuntimeError(f"request {rid!r} lost uncached blocks out of its window")
        self.pool.cache(blocks, req.block_hashes[done:full],
                        req.block_hashes[done - 1] if done else None,
                        req.all_token_ids[done * size:full * size])
        self._num_cached_blocks[rid] = full

    def trim(self, req: Request) -> None:
        """Return the request's blocks wholly past its tokens (a speculative step's rejected
        positions: their KV is never read, nor cached)."""
        blocks = self._blocks.get(req.request_id)
        keep = self.num_blocks_for(req.num_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        self.pool.release([b for b in extra[::-1] if b is not None])
        self._tables[req.request_id] = _table(blocks)

    def free(self, req: Request) -> None:
        """Return every block the request holds (tail first: its last blocks evict first)."""
        blocks = self._blocks.pop(req.request_id, [])
        self._tables.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)
        self._num_dropped.pop(req.request_id, None)
        self.pool.release([b for b in blocks[::-1] if b is not None])

    def hold(self, req: Request) -> None:
        """Hand a finished request's blocks to the ledger under its id (a KV handoff reads
        them) until `ledger.free_held`."""
        blocks = self._blocks.pop(req.request_id, [])
        if not _whole(blocks):  # hold_kv requests keep every block: never reached
            raise RuntimeError(f"request {req.request_id!r} lost blocks out of its window")
        self.ledger.keep(req.request_id, blocks)
        self._tables.pop(req.request_id, None)
        self._num_cached_blocks.pop(req.request_id, None)

    def hold_leading(self, hold_id: str, request_id: str, num_blocks: int) -> list[int]:
        """Hold a running request's first `num_blocks` blocks (one more reference) in the
        ledger for another worker to pull until `ledger.free_held(hold_id)`; their ids.
        Refused past a sliding window."""
        blocks = self._blocks.get(request_id, [])[:num_blocks]
        if not _whole(blocks):
            raise ValueError(f"request {request_id!r} returned blocks out of its window")
        return self.ledger.share(hold_id, blocks)

    def adopt(self, hold_id: str, request_id: str) -> None:
        """Blocks the ledger holds (reserved, and filled by a pull) become a new request's
        first blocks."""
        if request_id in self._blocks:
            raise ValueError(f"request {request_id!r} already holds blocks")
        blocks: list[KVBlock | None] = list(self.ledger.take(hold_id))  # the ledger's list ended
        self._blocks[request_id] = blocks
        self._tables[request_id] = _table(blocks)

    def reset_prefix_cache(self) -> bool:
        self.hot.clear()
        return self.pool.reset_prefix_cache()


def _whole(blocks: list[KVBlock | None]) -> TypeGuard[list[KVBlock]]:
    """Whether none of `blocks` was returned out of the window."""
    return None not in blocks


def _table(blocks: list[KVBlock | None]) -> tuple[int, ...]:
    """Block ids in token order; a returned block's entry repeats the first live block's id."""
    live = next((b.block_id for b in blocks if b is not None), 0)
    return tuple(live if b is None else b.block_id for b in blocks)
