"""Source and puller in separate processes, per transport: bytes, leases, failures."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtransfer import (KVLayout, LayoutMismatch, LeaseExpired, TransferAgent, TransferError,
                        TransportConfig)
from tests.kvtransfer.conftest import TRANSPORTS
from tests.kvtransfer.factories import (BlockPool, blocks_equal, make_layout, random_caches,
                                        zero_caches)
from tests.kvtransfer.peer import SourceProcess, SourceSpec, start_hanging_puller

LAYOUTS = (
    make_layout(dtype="bfloat16", block_size=16, num_kv_heads=8, head_dim=16),
    make_layout(dtype="float32", block_size=4),
    make_layout(dtype="float16", block_size=8, num_kv_heads=2, head_dim=64),
    make_layout(dtype="float8_e4m3fn", block_size=32, num_layers=2),
)
NUM_BLOCKS = 64


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_random_kv_lands_byte_exact_and_frees_both_pools(transport: str) -> None:
    source = SourceProcess(SourceSpec(transport, LAYOUTS, NUM_BLOCKS))
    try:
        async def pull_all() -> None:
            for i, (layout, handoff) in enumerate(zip(LAYOUTS, source.handoffs)):
                pool, caches = BlockPool(NUM_BLOCKS), zero_caches(layout, NUM_BLOCKS)
                agent = TransferAgent(layout, caches, TransportConfig(transport))
                await agent.start()
                local = pool.allocate(handoff.num_blocks, scattered=i % 2 == 1)
                landed: list[int] = []
                result = await agent.pull(handoff, local, on_layer=landed.append, timeout=30)
                await agent.close()
                expected = random_caches(layout, NUM_BLOCKS, i)
                assert blocks_equal(expected, handoff.block_ids, caches, local), layout
                assert landed == list(range(layout.num_layers))
                assert result.num_bytes == layout.bytes_per_block * handoff.num_blocks \
                    * layout.num_layers
                pool.free(local)
                assert pool.num_free == NUM_BLOCKS

        asyncio.run(pull_all())
        # every lease was consumed by its pull: the source freed its blocks without expiry
        assert wait_for(lambda: source.free_counts() == [NUM_BLOCKS] * len(LAYOUTS))
    finally:
        source.stop()


BIG = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_source_killed_mid_transfer_raises_typed_error_and_frees_destination(
        transport: str) -> None:
    # 8 layers of 8 MiB: far more than the socket buffers hold when the source dies
    source = SourceProcess(SourceSpec(transport, (BIG,), num_blocks=128, request_blocks=128))
    pool, caches = BlockPool(128), zero_caches(BIG, 128)

    async def pull() -> None:
        agent = TransferAgent(BIG, caches, TransportConfig(transport))
        await agent.start()
        local = pool.allocate(128)
        try:
            await agent.pull(source.handoffs[0], local, on_layer=lambda i: source.kill()
                             if i == 0 else None, timeout=20)
        finally:
            pool.free(local)  # what the decode worker does with a failed pull's blocks
            await agent.close()

    try:
        start = time.monotonic()
        with pytest.raises(TransferError):
            asyncio.run(pull())
        assert time.monotonic() - start < 20
        assert not source.process.is_alive()
        assert pool.num_free == 128
    finally:
        source.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_puller_killed_mid_transfer_frees_source_blocks_before_expiry(transport: str) -> None:
    source = SourceProcess(SourceSpec(transport, (BIG,), num_blocks=128, request_blocks=128,
                                      lease_s=120))
    try:
        puller = start_hanging_puller(BIG, source.handoffs[0], transport)
        assert source.free_counts() == [0]  # mid-transfer: the lease holds every block
        puller.kill()
        puller.join(10)
        # the cut-off pull consumed its reader long before the 120 s lease: blocks are back
        assert wait_for(lambda: source.free_counts() == [128], timeout_s=10)
    finally:
        source.stop()


def test_lease_expiry_frees_source_and_a_late_pull_is_refused() -> None:
    source = SourceProcess(SourceSpec("tcp", LAYOUTS[:1], NUM_BLOCKS, lease_s=0.5))
    try:
        assert wait_for(lambda: source.free_counts() == [NUM_BLOCKS], timeout_s=10)

        async def pull() -> None:
            agent = TransferAgent(LAYOUTS[0], zero_caches(LAYOUTS[0], NUM_BLOCKS))
            await agent.start()
            try:
                await agent.pull(source.handoffs[0], list(range(10)), timeout=10)
            finally:
                await agent.close()

        with pytest.raises(LeaseExpired):
            asyncio.run(pull())
    finally:
        source.stop()


def test_mismatched_layout_is_rejected_before_any_byte_lands() -> None:
    source = SourceProcess(SourceSpec("tcp", LAYOUTS[:1], NUM_BLOCKS))
    try:
        wrong = make_layout(**{**LAYOUTS[0].to_dict(), "dtype": "float16"})
        caches = zero_caches(wrong, NUM_BLOCKS)

        async def pull() -> None:
            agent = TransferAgent(wrong, caches)
            await agent.start()
            try:
                await agent.pull(source.handoffs[0], list(range(10)), timeout=10)
            finally:
                await agent.close()

        with pytest.raises(LayoutMismatch, match="dtype 'bfloat16' vs 'float16'"):
            asyncio.run(pull())
        assert all(not c.view(-1).view(dtype=c.dtype).abs().sum() for c in caches)
        assert source.free_counts() == [NUM_BLOCKS - 10]  # the lease still stands for a retry
    finally:
        source.stop()
