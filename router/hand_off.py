"""A leaving worker's cache, kept by the workers that stay (issue 23). Torch-free.

A scale-down or a planned restart should not cost the pool its prefix hits. Two parts:

- `coldest(workers, roles)`: which worker to remove when Cleave chooses: the one whose cache
  served the fewest blocks lately per block it has (`EngineStats.recent_hit_blocks`, decayed).
- `hand_off(workers, counters, source)`: before `source` stops, its hottest prefixes
  (`WorkerClient.hot_prefixes`) go to the survivors of its pool: each prefix to a survivor
  that does not hold it yet and has room (blocks no running request holds, less a quarter of
  its pool kept for its own traffic), the survivor with the least cache worth plus what it has
  taken first, so the hand-off spreads the hot prefixes (and their traffic) across the pool.
  The survivor pulls it under a lease (`export_prefix`, then `land_prefix`), evicting its own
  least recently used blocks if it must. A prefix that fails to move is only a lost hit.

When Serve picks the replica to remove (it offers no hook to choose one), the hand-off still
keeps the pool's hottest prefixes: what is lost is the survivors' least recently used blocks.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

from router.counters import RouterCounters
from router.workers import WorkerSet
from workers.contract.messages import PrefixFetch
from workers.contract.protocol import EngineStats, WorkerRole
from workers.contract.prefix_cache import HotPrefix

logger = logging.getLogger(__name__)

KEEP_FRACTION = 0.25  # of a survivor's blocks, left for its own traffic


def cache_worth(stats: EngineStats) -> float:
    """Blocks a worker's cache served lately (decayed), per block it has: what removing it
    costs the pool's hit rate."""
    return stats.recent_hit_blocks / max(stats.num_blocks, 1)


def coldest(workers: WorkerSet, roles: tuple[WorkerRole, ...]) -> str | None:
    """The healthy, not draining worker of `roles` whose cache is worth least lately, per block
    it has (ties: the last added, as Serve's own choice); None when there is none."""
    best: tuple[float, int] | None = None
    choice = None
    for order, wid in enumerate(workers.pool(*roles)):
        stats = workers.stats(wid)
        if wid in workers.draining or not workers.is_healthy(wid) or stats is None:
            continue
        key = (cache_worth(stats), -order)
        if best is None or key < best:
            best, choice = key, wid
    return choice


@dataclass
class _Survivor:
    worker_id: str
    room: int  # blocks it may still take
    worth: float  # its own cache's worth, plus what it has taken
    prefixes: list[HotPrefix] = field(default_factory=list)


def _survivors(workers: WorkerSet, source: str, role: WorkerRole) -> list[_Survivor]:
    out = []
    for wid in workers.pool(role):
        stats = workers.stats(wid)
        if wid == source or wid in workers.draining or stats is None \
                or not workers.is_healthy(wid):
            continue
        free = stats.num_blocks * (1.0 - stats.kv_usage)
        room = int(free - KEEP_FRACTION * stats.num_blocks)
        if room > 0:
            out.append(_Survivor(wid, room, stats.recent_hit_blocks))
    return out


def plan(workers: WorkerSet, source: str, role: WorkerRole,
         hot: tuple[HotPrefix, ...]) -> list[_Survivor]:
    """Each hot prefix (most worth first) to a survivor of `role` lacking it, with room."""
    survivors = _survivors(workers, source, role)
    for prefix in hot:
        held = workers.index.match_device(prefix.block_hashes)
        if any(held.get(s.worker_id, 0) >= len(prefix.block_hashes) for s in survivors):
            continue  # a survivor has it already: its traffic finds it there
        fits = [s for s in survivors if s.room >= len(prefix.block_hashes)]
        if not fits:
            continue
        target = min(fits, key=lambda s: s.worth)
        target.prefixes.append(prefix)
        target.room -= len(prefix.block_hashes)
        target.worth += prefix.worth
    return [s for s in survivors if s.prefixes]


async def hand_off(workers: WorkerSet, counters: RouterCounters, source: str) -> int:
    """Move `source`'s hottest prefixes to the survivors of its pool (see the module); the
    blocks landed. Never raises for a worker's failure: what does not move is only a miss."""
    client = workers.clients.get(source)
    if client is None:
        return 0
    role = workers.info(source).role
    room = sum(s.room for s in _survivors(workers, source, role))
    if room <= 0:
        return 0
    try:
        hot = await client.hot_prefixes(room)
    except Exception as exc:  # noqa: BLE001 -- the source failing: nothing to hand off
        logger.warning("hand-off from %s: cannot read its hot prefixes: %r", source, exc)
        return 0
    targets = plan(workers, source, role, hot)
    landed = await asyncio.gather(*(_send(workers, counters, source, t) for t in targets))
    if hot:
        logger.info("hand-off from %s: %d of %d hot prefixes, %d blocks, to %s", source,
                    sum(len(t.prefixes) for t in targets), len(hot), sum(landed),
                    [t.worker_id for t in targets])
    return sum(landed)


async def _send(workers: WorkerSet, counters: RouterCounters, source: str,
                target: _Survivor) -> int:
    """The target's prefixes, one pull at a time (each under its own lease)."""
    landed = 0
    src, dst = workers.clients[source], workers.clients.get(target.worker_id)
    for prefix in target.prefixes:
        if dst is None:
            break
        hold = f"handoff-{uuid.uuid4().hex[:16]}"  # made here, never taken from a client
        try:
            handoff = await src.export_prefix(hold, prefix.block_hashes,
                                              workers.info(target.worker_id).tp_size)
            if handoff is None:
                counters.count_fallback("hand_off_failed")
                continue
            n = len(handoff.ranks[0].block_ids)
            got = await dst.land_prefix(hold, PrefixFetch(handoff, prefix.block_hashes[:n]),
                                        prefix.token_ids)
        except Exception as exc:  # noqa: BLE001 -- either side failing: a lost hit only
            logger.warning("hand-off of a prefix from %s to %s failed: %r", source,
                           target.worker_id, exc)
            counters.count_fallback("hand_off_failed")
            continue
        if got:
            counters.num_hand_off_prefixes += 1
            counters.hand_off_blocks += got
            landed += got
        else:
            counters.count_fallback("hand_off_failed")
    return landed
