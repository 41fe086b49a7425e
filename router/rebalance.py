"""Rebalancing: running streams move, KV and all, off a decode-pool worker whose KV cache is
nearly full to one with room (issue 23). Torch-free.

Routing balances new requests; streams already running stay where they started, and long ones
can fill a worker's cache (it then preempts, recomputing what it evicts) while another has
room. With `RouterConfig.rebalance_kv_usage` set, every `kv_poll_interval_s` each decode-pool
worker at or above that KV usage gives its longest movable stream to the least used worker
at least `REBALANCE_GAP` below the bound (`LiveMigrations.move`: nothing recomputed, no token
repeated or lost). One stream per worker per round, and the gap, keep streams from bouncing.
"""

from __future__ import annotations

import asyncio
import logging

from router.live_migration import DECODE_POOL, LiveMigrations
from router.loads import LoadTable
from router.workers import WorkerSet

logger = logging.getLogger(__name__)

REBALANCE_GAP = 0.2  # a target's KV usage is at least this far below the bound


def pairs(loads: LoadTable, bound: float, draining: set[str]) -> list[tuple[str, str]]:
    """(source, target) per worker at or above `bound`, most used first, each to the least
    used healthy worker at least `REBALANCE_GAP` below it (a target takes one stream a round)."""
    usable = [(load.kv_usage, load.worker_id) for load in loads
              if load.healthy and load.worker_id not in draining]
    hot = sorted((u, w) for u, w in usable if u >= bound)[::-1]
    room = sorted((u, w) for u, w in usable if u <= bound - REBALANCE_GAP)
    return [(src, dst) for (_, src), (_, dst) in zip(hot, room)]


async def rebalance(workers: WorkerSet, migrations: LiveMigrations, bound: float) -> int:
    """One round (see the module); the streams moved."""
    moves = []
    for source, target in pairs(workers.pool_loads(*DECODE_POOL), bound, workers.draining):
        streams = migrations.on(source)
        if streams:
            longest = max(streams, key=lambda g: len(g.prompt_token_ids))
            moves.append(migrations.move(longest, target=target))
    moved = sum(await asyncio.gather(*moves))
    if moved:
        migrations.counters.num_rebalanced += moved
        logger.info("rebalancing: %d streams moved off workers at >= %.0f%% KV usage", moved,
                    100 * bound)
    return moved
