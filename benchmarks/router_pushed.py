"""`router_overhead.py`'s served-path half: the router's own routing step over a `WorkerSet`
whose loads and KV events are pushed, at any number of workers.

Each simulated worker is a `WorkerClient` that only counts what the router asks of it; its
channel's reports (`WorkerSet.on_outputs`: the engine's load and its new KV events) are
delivered between decisions, each worker reporting once per `report_interval_s` of simulated
time at the decision rate being measured. A decision is what `router.orchestrator` does for a
prompt in an aggregated deployment: hash the prompt's blocks, read the pool's loads, let the
policy choose, note the request as routed there. Calls to the workers during the decisions are
counted (the target is none: nothing is asked per request).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence

from router.orchestrator import DECODE_POOL
from router.policy import get_policy
from router.workers import WorkerSet
from workers.contract.protocol import (
    EngineStats,
    WorkerInfo,
    WorkerRole,
)
from workers.contract.prefix_cache import BlockStored, KVSnapshot, hash_prompt_blocks

CALLS: Counter[str] = Counter()  # what the router asked the simulated workers, by method


class SimulatedWorker:
    """A worker as the router sees it through its client: a description, a snapshot at start,
    and its reports. Generating is not simulated (never called while routing)."""

    def __init__(self, worker_id: str, block_size: int) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.listener = None
        self.epoch = f"epoch-{worker_id}"
        self.seq = 0

    async def info(self) -> WorkerInfo:
        CALLS["info"] += 1
        return WorkerInfo(self.worker_id, WorkerRole.BOTH, self.block_size, 4096, 32000, 100_000)

    def attach(self, listener: object) -> None:
        self.listener = listener

    async def stats(self) -> EngineStats:
        CALLS["stats"] += 1
        return EngineStats(0, 0, 0.0, 100_000, 0, 100_000)

    async def kv_snapshot(self) -> KVSnapshot:
        CALLS["kv_snapshot"] += 1
        return KVSnapshot(self.epoch, 0, frozenset())

    async def health(self) -> bool:
        CALLS["health"] += 1
        return True

    async def close(self) -> None:
        pass

    def stored(self, hashes: Sequence[int]) -> BlockStored:
        """The event of this worker storing blocks `hashes` (the next in its sequence)."""
        event = BlockStored(self.epoch, self.seq, tuple(hashes), None, (), self.block_size)
        self.seq += 1
        return event


def random_stats(rng: random.Random) -> EngineStats:
    return EngineStats(rng.randint(0, 8), rng.randint(0, 64), rng.random(), 50_000, 20_000,
                       100_000, num_pending_prompt_tokens=rng.randint(0, 4096))


async def build(num_workers: int, block_size: int, system_prompts: list[list[int]],
                num_blocks: int, rng: random.Random) -> tuple[WorkerSet, list[SimulatedWorker]]:
    """A started `WorkerSet` over `num_workers` simulated workers, its index fed through the
    workers' reports: each system prompt on 2-4 workers, then private chains to `num_blocks`."""
    sims = [SimulatedWorker(f"worker-{i:04d}", block_size) for i in range(num_workers)]
    workers = WorkerSet(sims)  # type: ignore[arg-type] - duck-typed clients
    await workers.start()
    for prompt in system_prompts:
        hashes = hash_prompt_blocks(prompt, block_size)
        for sim in rng.sample(sims, min(len(sims), rng.randint(2, 4))):
            workers.on_outputs(sim.worker_id, [sim.stored(hashes)], random_stats(rng))
    while workers.index.num_blocks < num_blocks:
        sim = rng.choice(sims)
        length = min(rng.randint(8, 128), num_blocks - workers.index.num_blocks)
        workers.on_outputs(sim.worker_id, [sim.stored([rng.getrandbits(63)
                                                       for _ in range(length)])],
                           random_stats(rng))
    return workers, sims


def decide_all(workers: WorkerSet, sims: list[SimulatedWorker], prompts: list[list[int]],
               block_size: int, reports_per_decision: float, rng: random.Random,
               clock) -> tuple[list[float], list[float]]:  # noqa: ANN001 - a timer
    """Route every prompt, delivering the reports due between decisions. Returns the sorted
    latencies of the decisions and of the reports (s)."""
    policy = get_policy("prefix_aware")
    decisions, reports = [], []
    due = 0.0
    stats = [random_stats(rng) for _ in range(64)]
    for i, prompt in enumerate(prompts):
        start = clock()
        hashes = hash_prompt_blocks(prompt, block_size)
        loads = workers.pool_loads(*DECODE_POOL)
        choice = policy.choose(hashes, loads, workers.index)
        workers.note_routed(choice.worker_id)
        decisions.append(clock() - start)
        due += reports_per_decision
        while due >= 1.0:
            due -= 1.0
            sim = sims[rng.randrange(len(sims))]
            event = sim.stored([rng.getrandbits(63)])  # a report carries the step's events
            start = clock()
            workers.on_outputs(sim.worker_id, [event], stats[i % 64])
            reports.append(clock() - start)
    return sorted(decisions), sorted(reports)


def run(num_workers: int, block_size: int, system_prompts: list[list[int]], num_blocks: int,
        prompts: list[list[int]], decisions_per_s: float, report_interval_s: float,
        seed: int, clock) -> dict:  # noqa: ANN001 - a timer
    """Build, warm up, measure; the calls the workers saw during the decisions."""
    rng = random.Random(seed)

    async def go() -> dict:
        workers, sims = await build(num_workers, block_size, system_prompts, num_blocks, rng)
        per_decision = num_workers / report_interval_s / decisions_per_s
        decide_all(workers, sims, prompts[:200], block_size, per_decision, rng, clock)
        CALLS.clear()
        decisions, reports = decide_all(workers, sims, prompts, block_size, per_decision, rng,
                                        clock)
        calls = dict(CALLS)
        await workers.stop()
        return {"decisions": decisions, "reports": reports, "calls": calls,
                "reports_per_decision": per_decision}

    return asyncio.run(go())
