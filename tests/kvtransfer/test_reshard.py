"""Resharding: a prefill pool at TP=p hands off to a decode pool at TP=d, byte-exact per head."""

from __future__ import annotations

import asyncio

import pytest

from kvtransfer import LayoutMismatch, LocalHub, TransferAgent, TransportConfig
from kvtransfer.plan import sources_for
from tests.kvtransfer.factories import (BlockPool, blocks_equal, make_layout, random_caches,
                                        zero_caches)

TOTAL_HEADS = 4
NUM_BLOCKS = 16


def rank_layout(rank: int, tp: int):
    return make_layout(num_kv_heads=TOTAL_HEADS // tp, tp_rank=rank, tp_size=tp)


@pytest.mark.parametrize("kind", ["local", "tcp"])
@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2)])
def test_each_decode_rank_pulls_exactly_its_heads(kind: str, p: int, d: int) -> None:
    async def run() -> None:
        hub = LocalHub()
        pools = [BlockPool(NUM_BLOCKS) for _ in range(p)]
        prefill = [TransferAgent(rank_layout(r, p), random_caches(rank_layout(r, p), NUM_BLOCKS,
                                                                  seed=r),
                                 TransportConfig(kind), on_release=pools[r].free, hub=hub)
                   for r in range(p)]
        decode = [TransferAgent(rank_layout(r, d), zero_caches(rank_layout(r, d), NUM_BLOCKS),
                                TransportConfig(kind), hub=hub) for r in range(d)]
        for agent in prefill + decode:
            await agent.start()
        src_ids = pools[0].allocate(5, scattered=True)
        for pool in pools[1:]:
            pool.allocate(5, scattered=True)  # every prefill rank holds the same block ids
        handoffs = [a.offer("r", src_ids, readers=max(1, d // p)) for a in prefill]
        dst_ids = [3, 4, 5, 9, 10]
        await asyncio.gather(*(a.pull(handoffs, dst_ids) for a in decode))

        per_src, per_dst = TOTAL_HEADS // p, TOTAL_HEADS // d
        for head in range(TOTAL_HEADS):
            src, dst = prefill[head // per_src], decode[head // per_dst]
            sh, dh = head % per_src, head % per_dst
            assert blocks_equal(src.caches, src_ids, dst.caches, dst_ids,
                                slice(sh, sh + 1), slice(dh, dh + 1)), f"head {head}"
        # every prefill rank's lease ended once all its readers pulled
        assert all(pool.num_free == NUM_BLOCKS for pool in pools)
        for agent in prefill + decode:
            await agent.close()

    asyncio.run(run())


def test_handoffs_missing_a_rank_are_rejected() -> None:
    from tests.kvtransfer.test_descriptors import make_handoff

    handoffs = [make_handoff(layout=rank_layout(r, 4)) for r in (0, 1, 3)]
    assert len(sources_for(rank_layout(0, 2), handoffs)) == 2
    with pytest.raises(LayoutMismatch, match=r"source TP ranks \[3\] cover 1 of the 2"):
        sources_for(rank_layout(1, 2), handoffs)
