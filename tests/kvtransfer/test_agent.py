"""The agent in one process (local and tcp transports): offers, pulls, leases and errors."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvtransfer import (Handoff, InvalidDescriptor, LayoutMismatch, LeaseExpired, LocalHub,
                        TransferAgent, TransferTimeout, TransportConfig)
from kvtransfer.wire import ReadRequest
from tests.kvtransfer.factories import (BlockPool, blocks_equal, make_layout, random_caches,
                                        zero_caches)

NUM_BLOCKS = 32


class Side:
    """One worker: an agent over its caches and a pool that frees on lease release."""

    def __init__(self, agent: TransferAgent, pool: BlockPool) -> None:
        self.agent, self.pool, self.caches = agent, pool, agent.caches


async def make_pair(kind: str, src_layout=None, dst_layout=None) -> tuple[Side, Side]:
    hub = LocalHub()
    sides = []
    for i, layout in enumerate((src_layout or make_layout(), dst_layout or make_layout())):
        pool = BlockPool(NUM_BLOCKS)
        caches = random_caches(layout, NUM_BLOCKS, 1) if i == 0 else zero_caches(layout,
                                                                                  NUM_BLOCKS)
        agent = TransferAgent(layout, caches, TransportConfig(kind), on_release=pool.free,
                              hub=hub)
        await agent.start()
        sides.append(Side(agent, pool))
    return sides[0], sides[1]


async def close(*sides: Side) -> None:
    for side in sides:
        await side.agent.close()


@pytest.mark.parametrize("kind", ["local", "tcp"])
def test_pull_lands_scattered_blocks_and_ends_the_lease(kind: str) -> None:
    async def run() -> None:
        src, dst = await make_pair(kind)
        ids = src.pool.allocate(7, scattered=True)
        handoff = src.agent.offer("r", ids)
        local = dst.pool.allocate(7)
        landed: list[int] = []
        result = await dst.agent.pull(handoff, local, on_layer=landed.append)
        assert blocks_equal(src.caches, ids, dst.caches, local)
        assert landed == [0, 1, 2]
        assert src.pool.num_free == NUM_BLOCKS and src.agent.num_leases == 0
        if kind == "tcp":  # one frame per layer however scattered the blocks
            assert result.num_messages == 3
        await close(src, dst)

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["local", "tcp"])
def test_cancel_releases_at_once_and_a_later_pull_is_refused(kind: str) -> None:
    async def run() -> None:
        src, dst = await make_pair(kind)
        handoff = src.agent.offer("r", src.pool.allocate(4))
        assert src.agent.cancel("r") == 1
        assert src.pool.num_free == NUM_BLOCKS
        assert src.agent.release(handoff.lease_id) is False  # release after cancel: harmless
        with pytest.raises(LeaseExpired):
            await dst.agent.pull(handoff, dst.pool.allocate(4))
        await close(src, dst)

    asyncio.run(run())


def test_a_pull_that_reaches_its_source_before_the_offer_waits_for_it() -> None:
    """A remote driver returns its handoff before its host has read the offer: a pull there
    first waits for the lease (`kvtransfer.control.LEASE_GRACE_S`) and lands; a lease never
    offered is still refused."""
    import dataclasses

    async def run() -> None:
        src, dst = await make_pair("tcp")
        ids = src.pool.allocate(3)
        shape = src.agent.offer("shape", ids)  # a handoff's other fields
        src.agent.release(shape.lease_id)
        handoff = dataclasses.replace(shape, request_id="r", lease_id="minted-by-a-driver")
        local = dst.pool.allocate(3)
        pull = asyncio.ensure_future(dst.agent.pull(handoff, local))
        await asyncio.sleep(0.02)  # the pull's request is at the source, the lease is not
        assert not pull.done()
        src.agent.offer("r", ids, lease_id="minted-by-a-driver")
        await pull
        assert blocks_equal(src.caches, ids, dst.caches, local)
        with pytest.raises(LeaseExpired, match="never granted"):
            await dst.agent.pull(dataclasses.replace(shape, lease_id="never"), local)
        await close(src, dst)

    asyncio.run(run())


def test_expiry_timer_frees_an_unpulled_lease() -> None:
    async def run() -> None:
        src, dst = await make_pair("tcp")
        src.agent.offer("r", src.pool.allocate(4), lease_s=0.05)
        await asyncio.sleep(0.2)
        assert src.pool.num_free == NUM_BLOCKS and src.agent.num_leases == 0
        await close(src, dst)

    asyncio.run(run())


def test_source_rejects_a_mismatched_layout_before_writing() -> None:
    async def run() -> None:
        src, dst = await make_pair("tcp")
        handoff = src.agent.offer("r", src.pool.allocate(4))
        # skip the puller's own check: ask the source directly with a wrong layout
        wrong = make_layout(head_dim=16)
        request = ReadRequest.one(handoff.lease_id, wrong, (0, 1, 2, 3))
        with pytest.raises(LayoutMismatch, match="head_dim 8 vs 16"):
            await dst.agent._transport.fetch(handoff.address, request, sink=None)
        assert all(not c.view(-1).abs().sum() for c in dst.caches)
        assert src.agent.num_leases == 1  # a refused pull keeps the lease for a correct one
        await close(src, dst)

    asyncio.run(run())


def test_puller_checks_block_counts_and_transport_before_connecting() -> None:
    async def run() -> None:
        src, dst = await make_pair("tcp")
        handoff = src.agent.offer("r", src.pool.allocate(4))
        with pytest.raises(LayoutMismatch, match="3 local blocks for a handoff of 4"):
            await dst.agent.pull(handoff, [0, 1, 2])
        with pytest.raises(InvalidDescriptor, match="transport 'ucx'"):
            await dst.agent.pull(Handoff.from_dict({**handoff.to_dict(),
                                                    "address": "ucx://127.0.0.1:1"}),
                                 [0, 1, 2, 3])
        with pytest.raises(InvalidDescriptor, match="offered block ids"):
            src.agent.offer("r2", [NUM_BLOCKS])
        await close(src, dst)

    asyncio.run(run())


def test_a_silent_source_times_out() -> None:
    async def run() -> None:
        src, dst = await make_pair("tcp")
        handoff = src.agent.offer("r", src.pool.allocate(2))
        with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
            address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
            stuck = Handoff.from_dict({**handoff.to_dict(), "address": address})
            with pytest.raises(TransferTimeout, match="0.2 s"):
                await dst.agent.pull(stuck, [0, 1], timeout=0.2)
        await close(src, dst)

    asyncio.run(run())


def test_close_releases_every_lease() -> None:
    async def run() -> None:
        src, dst = await make_pair("local")
        src.agent.offer("a", src.pool.allocate(3))
        src.agent.offer("b", src.pool.allocate(3))
        await close(src, dst)
        assert src.pool.num_free == NUM_BLOCKS

    asyncio.run(run())


def test_a_puller_that_stops_reading_cannot_hold_the_lease() -> None:
    """The source bounds each connection in time: a puller that asks for a read and then
    never confirms it (ReadDone) loses the read, and the expired lease frees its blocks."""
    from kvtransfer.wire import send_message

    async def run() -> None:
        src, dst = await make_pair("tcp")
        src.agent._transport._server.timeout_s = 0.5
        handoff = src.agent.offer("r", src.pool.allocate(2), lease_s=0.2)
        host, port = handoff.address.removeprefix("tcp://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.setblocking(False)
        try:
            await send_message(sock, ReadRequest.one(handoff.lease_id, dst.agent.layout, (0, 1)))
            for _ in range(100):  # the layers arrive; the puller never says ReadDone
                await asyncio.sleep(0.05)
                if src.agent.num_leases == 0:
                    break
            assert src.agent.num_leases == 0 and src.pool.num_free == NUM_BLOCKS
        finally:
            sock.close()
            await close(src, dst)

    asyncio.run(run())


def test_the_source_refuses_connections_beyond_its_cap_and_huge_control_messages() -> None:
    from kvtransfer.wire import HEADER, MAX_CONTROL_BYTES, MessageKind

    async def run() -> None:
        src, dst = await make_pair("tcp")
        server = src.agent._transport._server
        server.max_connections = 2
        address = ("127.0.0.1", server.port)
        held = [socket.create_connection(address) for _ in range(2)]
        await asyncio.sleep(0.1)
        extra = socket.create_connection(address)
        extra.settimeout(5)
        assert await asyncio.to_thread(extra.recv, 1) == b""  # closed at once
        huge = socket.create_connection(address)
        huge.settimeout(5)
        for s in held:
            s.close()
        await asyncio.sleep(0.1)
        huge.sendall(HEADER.pack(MessageKind.READ_REQUEST, 0, MAX_CONTROL_BYTES + 1))
        assert await asyncio.to_thread(huge.recv, 1) == b""  # refused, nothing allocated
        for s in (extra, huge):
            s.close()
        await close(src, dst)

    asyncio.run(run())


def test_an_injected_pull_failure_is_a_lost_peer(monkeypatch) -> None:
    from kvtransfer import PeerGone, faults

    monkeypatch.setattr(faults, "ENABLED", True)

    async def run() -> None:
        src, dst = await make_pair("tcp")
        handoff = src.agent.offer("r", src.pool.allocate(2))
        faults.arm("kv.pull", "raise")
        try:
            with pytest.raises(PeerGone, match="injected fault at kv.pull"):
                await dst.agent.pull(handoff, [0, 1])
            result = await dst.agent.pull(handoff, [0, 1])  # the next pass is clean
            assert result.num_bytes > 0
        finally:
            faults.disarm()
            await close(src, dst)

    asyncio.run(run())


def test_pair_groups_are_bounded_and_each_one_leaving_is_shut_down() -> None:
    from kvtransfer.collective import PairCache

    class Group:
        def __init__(self) -> None:
            self.shut = False

        def shutdown(self) -> None:
            self.shut = True

    groups = {k: Group() for k in "abcd"}
    cache = PairCache(lambda g: g, limit=2)
    cache.put("a", groups["a"])
    cache.put("b", groups["b"])
    assert cache.use("a") is groups["a"]  # now b is the least recently used
    cache.put("c", groups["c"])
    assert set(cache) == {"a", "c"} and groups["b"].shut and not groups["a"].shut
    cache.drop("a")  # a failed pull
    assert groups["a"].shut
    cache.put("d", groups["d"])
    cache.drop_all()  # the transport closes
    assert not cache and all(g.shut for g in groups.values())


def test_the_nccl_transport_on_a_loopback_host_listens_on_loopback_only() -> None:
    """torch's TCPStore listens on every interface whatever host it is given: on a loopback
    host the pair rendezvous goes through a FileStore instead, removed at close."""
    import os

    from tests.sockets import listening, loopback

    def open_to_all() -> set[tuple[str, int]]:
        return {a for a in listening() if not loopback(a[0])}

    async def run() -> None:
        before = open_to_all()
        src, dst = await make_pair("nccl")
        ids = src.pool.allocate(3)
        handoff = src.agent.offer("r", ids)
        local = dst.pool.allocate(3)
        await dst.agent.pull(handoff, local)
        assert blocks_equal(src.caches, ids, dst.caches, local)
        assert open_to_all() - before == set()
        store_file = handoff.address.split("/file:", 1)[1]
        assert os.path.exists(store_file)
        await close(src, dst)
        assert not os.path.exists(store_file)

    asyncio.run(run())
