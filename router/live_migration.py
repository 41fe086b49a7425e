"""Live migration, the router's half: moving running streams off a worker with their KV (a
drain; `cleave` draining a replica before a planned restart or a scale-down), so nothing is
recomputed and no client sees a gap. Torch-free.

The router keeps every generation it started (weakly: one that ended is gone or closed), and
`drain(worker_id)` marks the worker draining (no new requests) and moves each stream on it,
all its samples, to the least loaded other decode-pool worker (`Generation.move`: the workers'
two-pull protocol, `workers.migration`). A stream that cannot move (still handing over, a sample
with no token yet, or no worker can take it) finishes where it is, as a drain without migration
would.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from router.counters import RouterCounters
from router.policy import NoHealthyWorker, get_policy
from router.streams import Generation
from router.workers import WorkerSet
from workers.protocol import WorkerRole

logger = logging.getLogger(__name__)

DECODE_POOL = (WorkerRole.DECODE, WorkerRole.BOTH)


class LiveMigrations:
    """The router's running generations and the moves between workers. Event-loop thread."""

    def __init__(self, workers: WorkerSet, counters: RouterCounters) -> None:
        self.workers = workers
        self.counters = counters
        self.least_loaded = get_policy("least_loaded")
        self._running: weakref.WeakSet[Generation] = weakref.WeakSet()

    def track(self, gen: Generation) -> None:
        self._running.add(gen)

    def on(self, worker_id: str) -> list[Generation]:
        """The movable generations `worker_id` streams now."""
        return [g for g in list(self._running) if g.movable and g.worker_now == worker_id]

    async def move(self, gen: Generation, with_kv: bool = True,
                   target: str | None = None) -> bool:
        """Move a running stream, KV and all, to `target` (default: the least loaded other
        decode-pool worker that is not draining); False when none can take it or it cannot
        move now (it goes on where it is). Counted either way."""
        w = self.workers
        source = gen.worker_now
        if target is None:
            loads = w.pool_loads(*DECODE_POOL).without([source])
            try:
                target = self.least_loaded.choose((), loads, w.index).worker_id
            except NoHealthyWorker:
                self.counters.num_live_migrations_failed += 1
                return False
        w.note_routed(target)
        moved = await gen.move(w.clients[source], w.clients[target], with_kv)
        if moved:
            self.counters.num_live_migrations += 1
            self.counters.count_decode(target)
        else:
            self.counters.num_live_migrations_failed += 1
        return moved

    async def drain(self, worker_id: str, with_kv: bool = True) -> int:
        """Route nothing new to `worker_id` and move its running streams away; how many
        moved. `with_kv` False: the targets recompute the streams' KV (a replay: the
        baseline `benchmarks/drain.py` measures against)."""
        self.workers.draining.add(worker_id)
        moving = self.on(worker_id)
        results = await asyncio.gather(*(self.move(g, with_kv) for g in moving))
        if moving:
            logger.info("drain of %s: %d of %d streams moved with their KV", worker_id,
                        sum(results), len(moving))
        return sum(results)
