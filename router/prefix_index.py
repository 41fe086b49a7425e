"""Which worker holds which prefix-cache blocks, rebuilt from the workers' KV events.

Each worker publishes `BlockStored` / `BlockRemoved` / `AllBlocksCleared` events numbered
0, 1, 2, ... under an epoch that is new at every engine start. The index applies them in order;
a gap means it missed something, so it marks the worker for resync and waits for a `KVSnapshot`.

Layout: one dict from block hash to a bitmask of the workers holding it (one bit per worker
slot), so `match` walks a prompt's chained hashes with one dict lookup and one AND per block,
plus a set of hashes per worker for removal, clears and resync. Not thread-safe: use one index
per event loop (or guard it with a lock).

Tiers: a worker holds a block in its device pool or only in its host-memory tier (the events'
`medium`). Both hit; a second bitmask marks the host-only holders, and `match_tiers` counts how
many of a worker's leading hits must be copied back from host memory, which a policy scores at
the worker's measured cost of a host hit (`WorkerLoad.host_hit_cost`) rather than as free or as
a miss.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

from workers.contract.prefix_cache import (
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVSnapshot,
)

_MAX_RETIRED_EPOCHS = 8  # per worker: earlier engine starts whose late events are not replayed
_PACK_HASH = struct.Struct("<q").pack


@dataclass
class _WorkerView:
    """What the index believes about one worker, and where its event stream stands."""

    slot: int  # this worker's bit in the hash -> bitmask map
    epoch: str | None = None
    next_seq: int = 0  # the seq the index expects next in `epoch`
    needs_resync: bool = False
    blocks: set[int] = field(default_factory=set)  # in the device pool
    host_blocks: set[int] = field(default_factory=set)  # in the host tier (some also above)
    retired_epochs: list[str] = field(default_factory=list)  # oldest first


class PrefixIndex:
    """The router's view of every worker's prefix cache. Mutated only by `apply`, `resync` and
    `remove_worker`.

    A worker that needs resync keeps its last known blocks in `match` (a stale hint only costs a
    cache miss) until `resync` replaces them; events in its current epoch are ignored meanwhile.
    """

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # block hash -> bitmask of worker slots
        self._host_only: dict[int, int] = {}  # block hash -> slots holding it in host memory only
        self._views: dict[str, _WorkerView] = {}
        self._slot_owner: dict[int, str] = {}  # slot -> worker id
        self._free_slots: list[int] = []

    # -- membership ------------------------------------------------------------------------------

    def _view(self, worker_id: str) -> _WorkerView:
        view = self._views.get(worker_id)
        if view is None:
            if not isinstance(worker_id, str) or not worker_id:
                raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_owner)
            view = self._views[worker_id] = _WorkerView(slot)
            self._slot_owner[slot] = worker_id
        return view

    def workers(self) -> list[str]:
        """Every worker the index has heard of, sorted."""
        return sorted(self._views)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and its blocks. Unknown ids are ignored (removal may race)."""
        view = self._views.pop(worker_id, None)
        if view is None:
            return
        self._drop_blocks(view, view.blocks)
        self._drop_host_blocks(view, view.host_blocks)
        del self._slot_owner[view.slot]
        self._free_slots.append(view.slot)

    def worker_blocks(self, worker_id: str) -> frozenset[int]:
        """The hashes the index believes `worker_id` holds (empty for unknown workers)."""
        view = self._views.get(worker_id)
        return frozenset(view.blocks) if view is not None else frozenset()

    def worker_host_blocks(self, worker_id: str) -> frozenset[int]:
        """The hashes the index believes `worker_id` holds in its host tier."""
        view = self._views.get(worker_id)
        return frozenset(view.host_blocks) if view is not None else frozenset()

    def needs_resync(self, worker_id: str) -> bool:
        """True once the worker's event stream had a gap (or began mid-stream): call `resync`."""
        view = self._views.get(worker_id)
        return view is not None and view.needs_resync

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._holders)

    # -- block bookkeeping -----------------------------------------------------------------------

    def _add_blocks(self, view: _WorkerView, hashes: Sequence[int]) -> None:
        bit, holders = 1 << view.slot, self._holders
        for h in hashes:
            holders[h] = holders.get(h, 0) | bit
        view.blocks.update(hashes)
        if view.host_blocks:  # back in the device pool: no longer host-only
            _clear_bits(self._host_only, [h for h in hashes if h in view.host_blocks], ~bit)

    def _drop_blocks(self, view: _WorkerView, hashes: Sequence[int] | set[int]) -> None:
        bit, blocks = 1 << view.slot, view.blocks
        gone = [h for h in hashes if h in blocks]
        blocks.difference_update(gone)
        in_host = [h for h in gone if h in view.host_blocks] if view.host_blocks else []
        if in_host:  # still held, in host memory only
            gone = [h for h in gone if h not in view.host_blocks]
            for h in in_host:
                self._host_only[h] = self._host_only.get(h, 0) | bit
        _clear_bits(self._holders, gone, ~bit)

    def _add_host_blocks(self, view: _WorkerView, hashes: Sequence[int]) -> None:
        bit, holders, host_only = 1 << view.slot, self._holders, self._host_only
        for h in hashes:
            if h not in view.blocks:
                holders[h] = holders.get(h, 0) | bit
                host_only[h] = host_only.get(h, 0) | bit
        view.host_blocks.update(hashes)

    def _drop_host_blocks(self, view: _WorkerView, hashes: Sequence[int] | set[int]) -> None:
        gone = [h for h in hashes if h in view.host_blocks]
        view.host_blocks.difference_update(gone)
        only = [h for h in gone if h not in view.blocks]
        keep = ~(1 << view.slot)
        _clear_bits(self._host_only, only, keep)
        _clear_bits(self._holders, only, keep)

    def _start_epoch(self, view: _WorkerView, epoch: str) -> None:
        """The worker restarted: everything known about it is gone."""
        if epoch in view.retired_epochs:
            view.retired_epochs.remove(epoch)
        if view.epoch is not None:
            view.retired_epochs.append(view.epoch)
            del view.retired_epochs[:-_MAX_RETIRED_EPOCHS]
        self._drop_blocks(view, view.blocks)
        self._drop_host_blocks(view, view.host_blocks)
        view.epoch, view.next_seq, view.needs_resync = epoch, 0, False

    # -- event stream ----------------------------------------------------------------------------

    def apply(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        """Apply a worker's events in order. A new epoch drops the worker's blocks first; a seq
        below the expected one (a duplicate) is skipped; a seq above it (a gap), or a new epoch
        that does not start at seq 0, marks the worker for resync and skips what follows in that
        epoch. An event of an epoch the worker already left is dropped and marks it for resync
        too (epochs carry no order, so only a snapshot says which engine is the live one)."""
        view = self._view(worker_id)
        for event in events:
            if event.epoch != view.epoch:
                if event.epoch in view.retired_epochs:
                    # Epochs are unordered: this is either a dead engine's late event or the
                    # live engine's after a stale epoch slipped in. Only a snapshot can tell.
                    view.needs_resync = True
                    continue
                self._start_epoch(view, event.epoch)
            if view.needs_resync or event.seq < view.next_seq:
                continue
            if event.seq > view.next_seq:
                view.needs_resync = True
                continue
            self._apply_one(view, event)
            view.next_seq += 1

    def _apply_one(self, view: _WorkerView, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            if event.medium == HOST:
                self._add_host_blocks(view, event.block_hashes)
            else:
                self._add_blocks(view, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            if event.medium == HOST:
                self._drop_host_blocks(view, event.block_hashes)
            else:
                self._drop_blocks(view, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self._drop_blocks(view, view.blocks)
            self._drop_host_blocks(view, view.host_blocks)
        else:
            raise TypeError(f"expected BlockStored, BlockRemoved or AllBlocksCleared, "
                            f"got {type(event).__name__}")

    def resync(self, worker_id: str, snapshot: KVSnapshot) -> None:
        """Replace the worker's blocks with `snapshot` and expect `snapshot.next_seq` next in
        `snapshot.epoch`; buffered events older than that are then skipped as duplicates."""
        if snapshot.next_seq < 0:
            raise ValueError(f"snapshot.next_seq must be >= 0, got {snapshot.next_seq}")
        view = self._view(worker_id)
        if snapshot.epoch != view.epoch:
            self._start_epoch(view, snapshot.epoch)
        self._drop_host_blocks(view, view.host_blocks - snapshot.host_block_hashes)
        self._drop_blocks(view, view.blocks - snapshot.block_hashes)
        self._add_blocks(view, list(snapshot.block_hashes - view.blocks))
        self._add_host_blocks(view, list(snapshot.host_block_hashes - view.host_blocks))
        view.next_seq, view.needs_resync = snapshot.next_seq, False

    # -- lookup ----------------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Worker id -> how many LEADING blocks of `block_hashes` it holds in either tier (up
        to its first miss). Only workers holding at least the first block appear."""
        return self._match(block_hashes, self._holders.get)

    def match_device(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """`match` over the device pools only: the leading blocks a worker could hand another
        worker now (`export_prefix`)."""
        holders, host_only = self._holders, self._host_only

        def on_device(h: int, default: int) -> int:
            return holders.get(h, default) & ~host_only.get(h, 0)

        return self._match(block_hashes, on_device if host_only else holders.get)

    def _match(self, block_hashes: Sequence[int],
               holders_of: Callable[[int, int], int]) -> dict[str, int]:
        if not block_hashes:
            return {}
        mask = holders_of(block_hashes[0], 0)
        if not mask:
            return {}
        owner = self._slot_owner
        hits: dict[str, int] = {}
        for depth in range(1, len(block_hashes)):
            still = mask & holders_of(block_hashes[depth], 0)
            if still != mask:
                _credit(hits, owner, mask & ~still, depth)
                mask = still
                if not mask:
                    return hits
        _credit(hits, owner, mask, len(block_hashes))
        return hits


    def match_tiers(self, block_hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """Worker id -> (leading blocks it holds in either tier, how many of those only in its
        host tier)."""
        depths = self.match(block_hashes)
        host_only = self._host_only
        if not host_only:
            return {wid: (depth, 0) for wid, depth in depths.items()}
        tiers: dict[str, tuple[int, int]] = {}
        for wid, depth in depths.items():
            bit = 1 << self._views[wid].slot
            tiers[wid] = (depth, sum(1 for h in block_hashes[:depth]
                                     if host_only.get(h, 0) & bit))
        return tiers


def _clear_bits(masks: dict[int, int], hashes: Sequence[int], keep: int) -> None:
    """AND each hash's mask with `keep`; drop masks that become 0."""
    for h in hashes:
        mask = masks.get(h, 0) & keep
        if mask:
            masks[h] = mask
        else:
            masks.pop(h, None)


def _credit(hits: dict[str, int], owner: dict[int, str], mask: int, depth: int) -> None:
    """Record `depth` leading hits for every worker whose bit is set in `mask`."""
    while mask:
        low = mask & -mask
        hits[owner[low.bit_length() - 1]] = depth
        mask ^= low
