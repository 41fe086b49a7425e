"""Rebalancing: a decode-pool worker whose KV cache is nearly full moves a running stream, with
its KV, to a worker with room; the stream's text is what it would have been."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.config import RouterConfig
from router.loads import LoadTable
from router.policy import WorkerLoad
from router.rebalance import REBALANCE_GAP, pairs
from tests.router.conftest import NUM_BLOCKS, slow_steps, start_server, wait_until
from tests.router.test_metrics import scrape, total
from workers.engine.llm import LLM
from workers.contract.protocol import SamplingParams, WorkerRequest


def _loads(**usage: float) -> LoadTable:
    return LoadTable.of([WorkerLoad(w, 0, 1, u) for w, u in usage.items()])


def test_each_full_worker_gives_one_stream_to_a_worker_well_below_the_bound():
    loads = _loads(a=0.95, b=0.9, c=0.1, d=0.5, e=0.8)
    assert pairs(loads, 0.8, set()) == [("a", "c"), ("b", "d")]  # e is at the bound, no room
    assert pairs(loads, 0.8, {"c"}) == [("a", "d")]  # a draining worker takes nothing
    near = 0.8 - REBALANCE_GAP + 0.01
    assert pairs(_loads(a=0.99, b=near), 0.8, set()) == []  # b is not far enough below


def test_a_bound_outside_zero_to_one_is_refused():
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"rebalance_kv_usage must be in \(0, 1\]"):
            RouterConfig("m", rebalance_kv_usage=bad)


GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def test_streams_on_a_full_worker_move_to_the_empty_one_unchanged(tiny_model):
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(300)] for _ in range(3)]
    server = slow_steps(start_server(tiny_model, num_workers=2, rebalance_kv_usage=0.5), 0.01)
    router = server.router
    try:
        router.workers.draining.add("worker-1")  # every stream starts on worker 0

        async def run(i: int) -> list[int]:
            req = WorkerRequest(f"r{i}", tuple(prompts[i]), GREEDY)
            gen = await router.generate(req.prompt_token_ids, req.params)
            tokens = []
            async for event in gen.events():
                tokens.extend(event.token_ids)
            return tokens

        async def all_streams() -> list[list[int]]:
            tasks = [asyncio.ensure_future(run(i)) for i in range(3)]
            while len(router.migrations.on("worker-0")) < 3:  # all three are streaming
                await asyncio.sleep(0.01)
            router.workers.draining.discard("worker-1")  # now it may take streams
            return await asyncio.gather(*tasks)

        outputs = server.call(all_streams(), 120)
        assert router.counters.num_rebalanced >= 1
        assert total(scrape(server), "cleave_rebalanced_streams_total") >= 1
        assert router.counters.decodes_by_worker.get("worker-1", 0) >= 1
        llm = LLM(tiny_model, num_blocks=NUM_BLOCKS)
        assert outputs == [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]
        assert wait_until(lambda: all(c.channel.worker.resources()["leases"] == 0
                                      for c in server.clients))
    finally:
        server.stop()
