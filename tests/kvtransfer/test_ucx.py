"""The ucx transport keeps one endpoint per source across pulls: reuse, concurrency, recovery;
and an idle endpoint costs no CPU."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtransfer import LeaseExpired
from tests.kvtransfer.conftest import HAS_UCXX
from tests.kvtransfer.factories import blocks_equal
from tests.kvtransfer.test_agent import NUM_BLOCKS, Side, close, make_pair

pytestmark = pytest.mark.skipif(not HAS_UCXX, reason="the ucx transport needs the `ucxx` "
                                                     "package (pip install ucxx-cu12)")


async def all_released(src: Side, timeout_s: float = 5.0) -> bool:
    """The source ends a read once it has the puller's ReadDone, just after the pull returns."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while src.pool.num_free != NUM_BLOCKS or src.agent.num_leases:
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def test_concurrent_and_later_pulls_from_one_source_all_land_byte_exact() -> None:
    async def run() -> None:
        src, dst = await make_pair("ucx")
        ids = [src.pool.allocate(5, scattered=True) for _ in range(3)]
        handoffs = [src.agent.offer(f"r{i}", b) for i, b in enumerate(ids)]
        local = [dst.pool.allocate(5) for _ in range(3)]
        await asyncio.gather(*(dst.agent.pull(h, d, timeout=20)  # one endpoint, serialised
                               for h, d in zip(handoffs[:2], local[:2])))
        await dst.agent.pull(handoffs[2], local[2], timeout=20)  # reuses the cached endpoint
        assert all(blocks_equal(src.caches, s, dst.caches, d) for s, d in zip(ids, local))
        assert await all_released(src)
        await close(src, dst)

    asyncio.run(run())


def test_a_refused_pull_drops_the_endpoint_and_the_next_pull_reconnects() -> None:
    async def run() -> None:
        src, dst = await make_pair("ucx")
        ids = src.pool.allocate(4)
        refused = src.agent.offer("gone", src.pool.allocate(4))
        src.agent.cancel("gone")
        with pytest.raises(LeaseExpired):
            await dst.agent.pull(refused, dst.pool.allocate(4), timeout=20)
        local = dst.pool.allocate(4)
        await dst.agent.pull(src.agent.offer("r", ids), local, timeout=20)
        assert blocks_equal(src.caches, ids, dst.caches, local)
        assert await all_released(src)
        await close(src, dst)

    asyncio.run(run())


def test_an_idle_endpoint_leaves_the_event_loop_idle() -> None:
    async def run() -> None:
        src, dst = await make_pair("ucx")
        ids, local = src.pool.allocate(4), dst.pool.allocate(4)
        await dst.agent.pull(src.agent.offer("r", ids), local, timeout=20)
        assert await all_released(src)  # the source now waits for the next pull's request
        cpu = time.thread_time()
        await asyncio.sleep(1.0)
        assert time.thread_time() - cpu < 0.2  # a spinning wait takes most of the second
        await close(src, dst)

    asyncio.run(run())
