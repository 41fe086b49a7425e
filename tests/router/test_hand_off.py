"""A scale-down that keeps the pool's prefix hits: the coldest worker goes, and the worker
that goes hands its hottest prefixes to the ones that stay."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.counters import RouterCounters
from router.hand_off import coldest, hand_off
from router.workers import WorkerSet
from tests.router.conftest import NUM_BLOCKS, start_server, wait_until
from tests.router.fakes import FakeWorker, Script
from tests.router.test_metrics import scrape, total
from workers.engine.llm import LLM
from workers.contract.messages import Generate
from workers.contract.protocol import (
    EngineStats,
    SamplingParams,
    WorkerRequest,
)
from workers.contract.prefix_cache import BlockStored, HotPrefix, hash_prompt_blocks


def _stats(worth: float, kv_usage: float = 0.0, num_blocks: int = 256) -> EngineStats:
    return EngineStats(0, 0, kv_usage, num_blocks, 0, num_blocks, recent_hit_blocks=worth)


async def _workers(*fakes: FakeWorker, **stats: EngineStats) -> WorkerSet:
    ws = WorkerSet(list(fakes))
    await ws.start()
    for wid, s in stats.items():
        ws.on_outputs(wid, (), s)
    return ws


def _prefix(first: int, n: int, worth: float) -> HotPrefix:
    return HotPrefix(tuple(range(first, first + n)), tuple(range(n * 16)), worth)


def test_the_coldest_worker_per_block_is_chosen_and_a_draining_one_never():
    async def go():
        ws = await _workers(FakeWorker("a"), FakeWorker("b"), FakeWorker("c"),
                            a=_stats(40.0), b=_stats(10.0, num_blocks=64), c=_stats(12.0))
        roles = (ws.info("a").role,)
        assert coldest(ws, roles) == "c"  # 12 / 256 < 10 / 64 < 40 / 256
        ws.draining.add("c")
        assert coldest(ws, roles) == "b"
        await ws.stop()

    asyncio.run(go())


def test_with_equal_worth_the_newest_goes_as_serve_would_choose():
    async def go():
        ws = await _workers(FakeWorker("a"), FakeWorker("b"), a=_stats(0.0), b=_stats(0.0))
        assert coldest(ws, (ws.info("a").role,)) == "b"
        await ws.stop()

    asyncio.run(go())


def test_hot_prefixes_go_to_the_coldest_survivors_with_room_and_not_to_holders():
    async def go():
        src, warm, cold, full = (FakeWorker(w) for w in ("src", "warm", "cold", "full"))
        src.hot = (_prefix(100, 4, 30.0), _prefix(200, 8, 20.0), _prefix(300, 4, 10.0),
                   _prefix(400, 4, 5.0))
        # room: blocks free less a quarter of the pool: cold has 256 * (0.77 - 0.25) = 133,
        # full has none
        ws = await _workers(src, warm, cold, full, src=_stats(60.0), warm=_stats(25.0),
                            cold=_stats(0.0, kv_usage=0.23), full=_stats(0.0, kv_usage=0.8))
        ws.index.apply("warm", [BlockStored("e-warm", 0, tuple(range(300, 304)), None, (), 16)])
        counters = RouterCounters()
        landed = await hand_off(ws, counters, "src")
        # 100.. to cold (worth 0 -> 30), 200.. to warm (25 < 30), 300.. is on warm already,
        # 400.. to cold (30 < 45)
        assert [n for _, n in cold.calls.lands] == [4, 4]
        assert [n for _, n in warm.calls.lands] == [8] and full.calls.lands == []
        assert landed == 16 and counters.num_hand_off_prefixes == 3
        assert counters.hand_off_blocks == 16
        holds = [h for h, _ in cold.calls.lands + warm.calls.lands]
        assert len(set(holds)) == 3 and all(h.startswith("handoff-") for h in holds)
        await ws.stop()

    asyncio.run(go())


def test_a_source_that_refuses_to_export_costs_only_the_hits():
    async def go():
        src, dst = FakeWorker("src", script=Script(refuse=True)), FakeWorker("dst")
        src.hot = (_prefix(1, 4, 9.0),)
        ws = await _workers(src, dst, src=_stats(9.0), dst=_stats(0.0))
        counters = RouterCounters()
        assert await hand_off(ws, counters, "src") == 0
        assert counters.fallbacks == {"hand_off_failed": 1} and dst.calls.lands == []
        assert await hand_off(ws, counters, "gone") == 0  # a worker already removed
        await ws.stop()

    asyncio.run(go())


# ---- real engines ------------------------------------------------------------------------------

BLOCK = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def trio(tiny_model):
    server = start_server(tiny_model, num_workers=3)
    yield server
    server.stop()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def _run(server, i: int, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    worker = server.clients[i].channel.worker

    async def go() -> tuple[list[int], int]:
        tokens, cached = [], 0
        async for event in worker.stream(Generate(WorkerRequest(rid, tuple(prompt), GREEDY))):
            tokens.extend(event.token_ids)
            cached = max(cached, event.num_cached_tokens)
        return tokens, cached

    return server.call(go())


def test_a_drained_worker_hands_its_hot_prefix_to_the_coldest_survivor(trio, tiny_model):
    router = trio.router
    ids = [c.worker_id for c in trio.clients]
    hot_shared, warm_shared = _prompt(1, 8 * BLOCK), _prompt(2, 8 * BLOCK)
    for k in range(3):  # worker 0's prefix is hit twice, worker 1's once, worker 2's never
        _run(trio, 0, f"h{k}", hot_shared + _prompt(10 + k, 5))
    for k in range(2):
        _run(trio, 1, f"w{k}", warm_shared + _prompt(20 + k, 5))
    _run(trio, 2, "c0", _prompt(3, 8 * BLOCK + 5))
    assert wait_until(lambda: (router.workers.stats(ids[0]) or _stats(0)).recent_hit_blocks
                      > 0 and (router.workers.stats(ids[1]) or _stats(0)).recent_hit_blocks > 0)
    assert router.coldest() == ids[2]

    moved = trio.call(router.drain(ids[0]))  # worker 0 leaves (a planned restart, say)
    assert moved == 0 and router.counters.num_hand_off_prefixes == 1
    assert router.counters.hand_off_blocks == 8
    m = scrape(trio)  # what an operator sees
    assert total(m, "cleave_hand_off_prefixes_total") == 1
    assert total(m, "cleave_hand_off_blocks_total") == 8
    hashes = hash_prompt_blocks(hot_shared, BLOCK)
    assert wait_until(lambda: router.workers.index.match_device(hashes).get(ids[2]) == 8)

    # the hot prefix's next request, on the survivor that took it: a hit, the same tokens
    prompt = hot_shared + _prompt(30, 5)
    tokens, cached = _run(trio, 2, "after", prompt)
    assert cached == 8 * BLOCK
    llm = LLM(tiny_model, num_blocks=NUM_BLOCKS)
    assert tokens == list(llm.generate([prompt], GREEDY)[0].outputs[0].token_ids)

    def idle() -> bool:
        return all(c.channel.worker.resources() == {"leases": 0, "held_requests": 0,
                                                    "pulls": 0, "prefills": 0}
                   and trio.call(c.stats()).num_free_blocks == NUM_BLOCKS
                   for c in trio.clients)

    assert wait_until(idle)  # both ends let go of the hand-off's blocks and leases
    router.workers.draining.discard(ids[0])
