"""Pulls from one source that start together go as one read, and fail part by part."""

from __future__ import annotations

import asyncio

import pytest

from kvtransfer import LeaseExpired
from tests.kvtransfer.factories import blocks_equal
from tests.kvtransfer.test_agent import NUM_BLOCKS, close, make_pair


@pytest.mark.parametrize("kind", ["local", "tcp"])
def test_pulls_started_together_go_as_one_read(kind: str) -> None:
    async def run() -> None:
        src, dst = await make_pair(kind)
        sources = [src.pool.allocate(n, scattered=True) for n in (1, 2, 3, 2)]
        handoffs = [src.agent.offer(f"r{i}", ids) for i, ids in enumerate(sources)]
        locals_ = [dst.pool.allocate(len(ids)) for ids in sources]
        landed: list[list[int]] = [[] for _ in sources]
        results = await asyncio.gather(*(
            dst.agent.pull(h, local, on_layer=landed[i].append)
            for i, (h, local) in enumerate(zip(handoffs, locals_))))
        assert dst.agent.num_reads == 1
        for ids, local in zip(sources, locals_):
            assert blocks_equal(src.caches, ids, dst.caches, local)
        assert landed == [[0, 1, 2]] * 4
        assert src.pool.num_free == NUM_BLOCKS and src.agent.num_leases == 0
        assert [r.num_bytes for r in results] == [h.num_bytes for h in handoffs]
        assert {r.read_bytes for r in results} == {sum(h.num_bytes for h in handoffs)}
        if kind == "tcp":  # one frame per layer for all four
            assert {r.num_messages for r in results} == {3}
        # one after the other, they go on their own
        again = src.pool.allocate(1)
        await dst.agent.pull(src.agent.offer("again", again), locals_[0][:1])
        assert blocks_equal(src.caches, again, dst.caches, locals_[0][:1])
        assert dst.agent.num_reads == 2
        await close(src, dst)

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["local", "tcp"])
def test_a_part_whose_lease_is_gone_fails_alone(kind: str) -> None:
    async def run() -> None:
        src, dst = await make_pair(kind)
        sources = [src.pool.allocate(2, scattered=True) for _ in range(3)]
        handoffs = [src.agent.offer(f"r{i}", ids) for i, ids in enumerate(sources)]
        src.agent.cancel("r1")  # the client of r1 went away
        locals_ = [dst.pool.allocate(2) for _ in sources]
        results = await asyncio.gather(*(dst.agent.pull(h, local)
                                         for h, local in zip(handoffs, locals_)),
                                       return_exceptions=True)
        assert isinstance(results[1], LeaseExpired) and handoffs[1].lease_id in str(results[1])
        assert not isinstance(results[0], BaseException)
        assert not isinstance(results[2], BaseException)
        for i in (0, 2):
            assert blocks_equal(src.caches, sources[i], dst.caches, locals_[i])
        assert dst.agent.num_reads == 2  # sent again without the rejected part
        assert src.pool.num_free == NUM_BLOCKS and src.agent.num_leases == 0
        await close(src, dst)

    asyncio.run(run())


def test_a_cancelled_puller_returns_once_its_read_has_ended() -> None:
    async def run() -> None:
        src, dst = await make_pair("tcp")
        ids = src.pool.allocate(NUM_BLOCKS // 2)
        handoff = src.agent.offer("r", ids)
        task = asyncio.ensure_future(dst.agent.pull(handoff, dst.pool.allocate(len(ids))))
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # nothing can write into the caller's blocks any more: the read is over on both sides
        assert src.agent.num_leases == 0 and src.pool.num_free == NUM_BLOCKS
        await close(src, dst)

    asyncio.run(run())
