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
from dataclasses import dataclass

from router.counters import RouterCounters
from router.policy import NoHealthyWorker, get_policy
from router.streams import Generation
from router.worker_client import TokenStream, WorkerClient
from router.workers import WorkerSet
from workers.messages import MigratedKV, ResumedSample
from workers.protocol import WorkerRole

logger = logging.getLogger(__name__)

DECODE_POOL = (WorkerRole.DECODE, WorkerRole.BOTH)
# first pulls under way at once in a `move_all`: each is a bulk copy, and many at once crowd the
# event loops that also carry the workers' token streams (measured by `benchmarks/drain.py`)
BULK_PULLS = 2


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
        return (await self.move_all([gen], with_kv, target))[0]

    async def move_all(self, gens: list[Generation], with_kv: bool = True,
                       target: str | None = None) -> list[bool]:
        """`move` for several streams in two phases: every first pull (`BULK_PULLS` at a time),
        then every pause and resume at once, so the streams of one source pause at the same
        step boundary and start on their targets in one batch (no stream waits for another's
        pull)."""
        bulk = asyncio.Semaphore(BULK_PULLS)

        async def prepare(gen: Generation) -> PreparedMove | None:
            async with bulk:
                return await self._prepare(gen, with_kv, target)

        prepared = await asyncio.gather(*(prepare(g) for g in gens))
        results = await asyncio.gather(*(
            finish_move(g, m) if m is not None else _false() for g, m in zip(gens, prepared)))
        for moved, m in zip(results, prepared):
            if moved:
                self.counters.num_live_migrations += 1
                self.counters.count_decode(m.target.worker_id)  # type: ignore[union-attr]
            else:
                self.counters.num_live_migrations_failed += 1
        return list(results)

    async def _prepare(self, gen: Generation, with_kv: bool,
                       target: str | None) -> PreparedMove | None:
        w = self.workers
        source = gen.worker_now
        if target is None:
            loads = w.pool_loads(*DECODE_POOL).without([source])
            try:
                target = self.least_loaded.choose((), loads, w.index).worker_id
            except NoHealthyWorker:
                return None
        w.note_routed(target)
        return await prepare_move(gen, w.clients[source], w.clients[target], with_kv)

    async def drain(self, worker_id: str, with_kv: bool = True) -> int:
        """Route nothing new to `worker_id` and move its running streams away; how many
        moved. `with_kv` False: the targets recompute the streams' KV (a replay: the
        baseline `benchmarks/drain.py` measures against)."""
        self.workers.draining.add(worker_id)
        moving = self.on(worker_id)
        results = await self.move_all(moving, with_kv)
        if moving:
            logger.info("drain of %s: %d of %d streams moved with their KV", worker_id,
                        sum(results), len(moving))
        return sum(results)


@dataclass
class PreparedMove:
    """A live migration between its halves (`prepare_move`, `finish_move`)."""

    source: WorkerClient
    target: WorkerClient
    tp: int  # the target's tensor-parallel size
    with_kv: bool
    landed: dict[int, int]  # blocks the first pull landed on the target, by sample index
    moved: asyncio.Future[tuple[str, TokenStream, WorkerClient | None]]  # `Generation.begin_move`


async def prepare_move(gen: Generation, source: WorkerClient, target: WorkerClient,
                       with_kv: bool = True) -> PreparedMove | None:
    """A move's first half: `target` pulls the KV `source` (streaming `gen` now) has computed,
    while it decodes on; None, with nothing changed, when it cannot move now. `with_kv`
    False: the target will recompute the KV instead (a replay, the baseline)."""
    if not gen.movable:
        return None
    rid, tp = gen.req.request_id, (await target.info()).tp_size
    landed: dict[int, int] = {}
    try:
        if with_kv:
            first = await source.export_running(rid, tp)
            landed = await target.prepare_migration(rid, first) if first else {}
    except Exception as exc:  # noqa: BLE001 -- it stays where it is
        logger.warning("request %s stays on %s: %r", rid, source.worker_id, exc)
        return None
    if not gen.movable:  # closed meanwhile
        return None
    return PreparedMove(source, target, tp, with_kv, landed, gen.begin_move())


async def finish_move(gen: Generation, m: PreparedMove) -> bool:
    """A prepared move's second half: pause the stream on its source (its stream there ends
    with `RequestMoved` after every token it produced) and open it on the target after
    exactly the tokens each sample sent; True once the target streams it. False when it did
    not pause (it ended, or its source failed: its stream then ends, or moves by recompute,
    on its own)."""
    rid = gen.req.request_id
    try:
        paused = await m.source.pause(rid, m.tp)
    except Exception as exc:  # noqa: BLE001
        logger.warning("request %s did not pause on %s: %r", rid, m.source.worker_id, exc)
        gen.cancel_move()
        return False
    stream = m.target.resume(gen.req, [ResumedSample(
        p.index, p.output_token_ids,
        MigratedKV(p.num_kv_tokens, m.landed.get(p.index, 0), p.handoff) if m.with_kv else None)
        for p in paused.samples])
    m.moved.set_result((m.target.worker_id, stream, None if m.with_kv else m.source))
    return True


async def _false() -> bool:
    return False
