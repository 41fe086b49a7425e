"""Live migration, the router's half: moving running streams off a worker with their KV (a
drain; `cleave` draining a replica before a planned restart or a scale-down), so nothing is
recomputed and no client sees a gap. Torch-free.

The router keeps every generation it started (weakly: one that ended is gone or closed), and
`drain(worker_id)` marks the worker draining (no new requests) and moves each stream on it,
all its samples, to the least loaded other decode-pool worker (`Move`: the workers' two-pull
protocol, `workers.serving.migration`), every stream phase by phase (`move_all`); a request that
starts there after the drain began (it was queued or in its prefill) moves at its first token.
A stream that cannot move (still handing over, a sample with no token yet, a failed pull, or
no worker can take it) finishes where it is, as a drain without migration would; both workers
then let go of what the move held at once (`cancel_migration`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.counters import RouterCounters
from router.policy import NoHealthyWorker, get_policy
from router.streams import Generation
from router.worker_client import TokenStream, WorkerClient
from router.workers import WorkerSet
from workers.contract.messages import MigratedKV, Paused, ResumedSample
from workers.contract.protocol import WorkerRole
from workers.contract.tracing import tracing

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff

logger = logging.getLogger(__name__)

DECODE_POOL = (WorkerRole.DECODE, WorkerRole.BOTH)
# first pulls under way at once in a `move_all`: each is a bulk copy, and many at once crowd the
# event loops that also carry the workers' token streams (measured by `benchmarks/drain.py`)
BULK_PULLS = 1
# after each bulk pull, a rest this many times as long as the pull took: the copies take at most
# 1 / (1 + BULK_REST) of the time, so the sources (decoding on meanwhile) keep their cores and
# memory bandwidth (on 2 cores, unpaced bulk pulls slowed the source's steps by 25-75%)
BULK_REST = 1.0
RESUME_WAIT_S = 30.0  # a drain waits this long at most for its moved streams to stream again


class LiveMigrations:
    """The router's running generations and the moves between workers. Event-loop thread."""

    def __init__(self, workers: WorkerSet, counters: RouterCounters) -> None:
        self.workers = workers
        self.counters = counters
        self.least_loaded = get_policy("least_loaded")
        self._running: weakref.WeakSet[Generation] = weakref.WeakSet()
        self._drain_with_kv: dict[str, bool] = {}  # how each drained worker's streams move
        self._late_moves: set[asyncio.Task[bool]] = set()

    def track(self, gen: Generation) -> None:
        """A generation started (its first token arrived). One that started on a worker
        being drained (it was queued or in its prefill when the drain began), or on one
        switched to the prefill role since (`Router.switch_role`), moves at once."""
        self._running.add(gen)
        worker = gen.worker_now
        switched = (worker in self.workers.clients  # assigned (`router.role_switch`)
                    and self.workers.info(worker).role == WorkerRole.BOTH
                    and self.workers.role_of(worker) == WorkerRole.PREFILL)
        if switched or (worker in self.workers.draining and worker in self._drain_with_kv):
            task = asyncio.get_running_loop().create_task(
                self.move(gen, self._drain_with_kv.get(worker, True)))
            self._late_moves.add(task)
            task.add_done_callback(self._late_moves.discard)

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
        """`move` for several streams, each phase for all of them before the next:
        1. every source offers its streams' computed blocks (one step boundary per source);
        2. the targets pull them, `BULK_PULLS` at a time, each followed by a rest
           (`BULK_REST`), while the sources decode on;
        3. every stream pauses (again one boundary per source);
        4. every target is handed its streams in one batch of `Resume`s, so they start there
           together, each with the few blocks its source wrote since (1).
        No stream waits for another's bulk pull between its pause and its first token."""
        moves = await asyncio.gather(*(self._start(g, with_kv, target) for g in gens))
        bulk = asyncio.Semaphore(BULK_PULLS)
        loop = asyncio.get_running_loop()

        waiting = sum(1 for m in moves if m)

        async def pull(m: Move) -> bool:
            nonlocal waiting
            async with bulk:
                waiting -= 1
                start = loop.time()
                pulled = await m.pull()
                if waiting:  # no rest after the last: the pauses wait for it
                    await asyncio.sleep((loop.time() - start) * BULK_REST)
                return pulled

        pulled = await asyncio.gather(*(pull(m) if m else _false() for m in moves))
        moves = [m if ok else None for m, ok in zip(moves, pulled)]
        paused = await asyncio.gather(*(m.pause() if m else _false() for m in moves))
        for m, ok in zip(moves, paused):
            if m is not None and ok:
                m.hand_over()
                self.counters.num_live_migrations += 1
                self.counters.count_decode(m.target.worker_id)
            else:
                self.counters.num_live_migrations_failed += 1
            if m is not None:
                m.trace(ok)
        return list(paused)

    async def _start(self, gen: Generation, with_kv: bool, target: str | None) -> Move | None:
        """Phase 1 of a move: its target chosen, and its source's computed blocks offered."""
        w = self.workers
        source = gen.worker_now
        if target is None:
            loads = w.pool_loads(*DECODE_POOL).without([source])
            try:
                target = self.least_loaded.choose((), loads, w.index, gen.req.lora_name).worker_id
            except NoHealthyWorker:
                return None
        w.note_routed(target, gen.req.lora_name)
        m = Move(gen, w.clients[source], w.clients[target], with_kv)
        return m if await m.export() else None

    async def drain(self, worker_id: str, with_kv: bool = True) -> int:
        """Route nothing new to `worker_id` and move its running streams away; how many
        moved (those still starting there move at their first token, `track`). Returns once
        each moved stream has streamed from its target (at most `RESUME_WAIT_S`): the targets
        have then reported the KV they took, so a hand-off after it does not send it again,
        nor compete with their first steps. `with_kv` False: the targets recompute the
        streams' KV (a replay: the baseline `benchmarks/drain.py` measures against)."""
        self.workers.draining.add(worker_id)
        self._drain_with_kv[worker_id] = with_kv
        moving = self.on(worker_id)
        results = await self.move_all(moving, with_kv)
        resumed = [g.resumed for g, ok in zip(moving, results) if ok and g.resumed]
        if resumed:
            await asyncio.wait(resumed, timeout=RESUME_WAIT_S)
        if moving:
            logger.info("drain of %s: %d of %d streams moved with their KV", worker_id,
                        sum(results), len(moving))
        return sum(results)

    def end_drain(self, worker_id: str) -> None:
        """Route to `worker_id` again (a role switch drained it; it stays in the worker set)."""
        self.workers.draining.discard(worker_id)
        self._drain_with_kv.pop(worker_id, None)


@dataclass
class Move:
    """One stream's live migration from `source` (streaming it now) to `target`, phase by
    phase (`LiveMigrations.move_all`): `export`, `pull`, `pause`, `hand_over`. A phase that
    returns False leaves the stream where it is, going on. `with_kv` False: the target
    recomputes the KV instead (a replay, the baseline)."""

    gen: Generation
    source: WorkerClient
    target: WorkerClient
    with_kv: bool
    tp: int = 1  # the target's tensor-parallel size
    exported: dict[int, KVHandoff] = field(default_factory=dict)  # by sample index
    landed: dict[int, int] = field(default_factory=dict)  # blocks the first pull landed
    paused: Paused | None = None
    moved: asyncio.Future[tuple[str, TokenStream, WorkerClient | None]] | None = None
    started_ns: int = field(default_factory=time.time_ns)

    @property
    def request_id(self) -> str:
        return self.gen.req.request_id

    async def export(self) -> bool:
        """The source offers the stream's computed blocks (it decodes on)."""
        if not self.gen.movable:
            return False
        try:
            self.tp = (await self.target.info()).tp_size
            if self.with_kv:
                self.exported = await self.source.export_running(self.request_id, self.tp)
        except Exception as exc:  # noqa: BLE001 -- it stays where it is
            logger.warning("request %s stays on %s: %r", self.request_id,
                           self.source.worker_id, exc)
            return False
        return True

    async def pull(self) -> bool:
        """The target pulls what was offered; the stream is then marked moving."""
        try:
            if self.exported:
                self.landed = await self.target.prepare_migration(self.request_id,
                                                                  self.exported)
        except Exception as exc:  # noqa: BLE001 -- it stays where it is
            logger.warning("request %s stays on %s: the pull to %s failed: %r",
                           self.request_id, self.source.worker_id, self.target.worker_id, exc)
            await self.cancel()
            return False
        if not self.gen.movable:  # closed meanwhile
            await self.cancel()
            return False
        self.moved = self.gen.begin_move()
        return True

    async def pause(self) -> bool:
        """The source stops the stream between two steps (its stream there ends with
        `RequestMoved` after every token it produced); False when it did not pause (it
        ended, or its source failed: its stream then ends, or moves by recompute, on its
        own)."""
        try:
            self.paused = await self.source.pause(self.request_id, self.tp)
        except Exception as exc:  # noqa: BLE001
            logger.warning("request %s did not pause on %s: %r", self.request_id,
                           self.source.worker_id, exc)
            self.gen.cancel_move()
            await self.cancel()
            return False
        return True

    async def cancel(self) -> None:
        """Both workers let go of what this move holds there now (not when leases end)."""
        if not self.with_kv:
            return
        for client in (self.source, self.target):
            try:
                await client.cancel_migration(self.request_id)
            except Exception as exc:  # noqa: BLE001 -- gone: its leases end with it
                logger.warning("worker %s did not cancel the move of %s: %r", client.worker_id,
                               self.request_id, exc)

    def trace(self, moved: bool) -> None:
        """The move as one span of the request's trace, export to hand-over."""
        tracing().record("router.live_migration", self.gen.req.traceparent, self.started_ns,
                         time.time_ns(), {"from_worker": self.source.worker_id,
                                          "to_worker": self.target.worker_id, "moved": moved,
                                          "with_kv": self.with_kv,
                                          "kv_blocks": sum(self.landed.values())})

    def hand_over(self) -> None:
        """Open the stream on the target after exactly the tokens each sample sent; the
        generation reads on from it."""
        assert self.paused is not None and self.moved is not None
        stream = self.target.resume(self.gen.req, [ResumedSample(
            p.index, p.output_token_ids,
            MigratedKV(p.num_kv_tokens, self.landed.get(p.index, 0), p.handoff)
            if self.with_kv else None) for p in self.paused.samples])
        self.moved.set_result((self.target.worker_id, stream,
                               None if self.with_kv else self.source))


async def _false() -> bool:
    return False
