"""An agent in the process that holds the cache, driven over its control connection: offers
return at once and are served by the host, pulls land in the host's cache, every lease's end
reaches the driver once, and a host that goes away fails pulls in flight and ends every lease.

The host runs on its own thread and event loop here, as in a rank process; the driver and a
plain `TransferAgent` puller share the test's loop.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvtransfer import AgentHost, LeaseExpired, PeerGone, RemoteAgent, TransferAgent
from kvtransfer.transport import TransportConfig
from tests.kvtransfer.factories import blocks_equal, make_layout, random_caches, zero_caches

TCP = TransportConfig("tcp")
LAYOUT = make_layout()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_remote_offer_is_pulled_from_the_hosts_cache_and_its_end_reaches_the_driver():
    src = random_caches(LAYOUT, 8, seed=1)
    host = AgentHost(src, tp_rank=0, tp_size=1)
    address = host.start("127.0.0.1")
    released = []

    async def go():
        driver = await RemoteAgent.connect(address, TCP, on_release=released.append)
        assert driver.layout == LAYOUT and driver.num_blocks == 8
        handoff = driver.offer("r", [5, 1, 2])
        assert handoff.address.startswith("tcp://") and driver.num_leases == 1
        dst = zero_caches(LAYOUT, 4)
        puller = TransferAgent(LAYOUT, dst, TCP)
        await puller.start()
        result = await puller.pull(handoff, [0, 3, 1])
        assert result.num_bytes == 3 * LAYOUT.num_layers * LAYOUT.bytes_per_block
        assert blocks_equal(src, [5, 1, 2], dst, [0, 3, 1])
        for _ in range(100):  # the host reports the read lease's end
            if released:
                break
            await asyncio.sleep(0.01)
        assert released == [(5, 1, 2)] and driver.num_leases == 0
        await puller.close()
        await driver.close()

    try:
        run(go())
    finally:
        host.stop()


def test_a_remote_pull_lands_in_the_hosts_cache_and_errors_keep_their_type():
    dst = zero_caches(LAYOUT, 6)
    host = AgentHost(dst, tp_rank=0, tp_size=1)
    address = host.start("127.0.0.1")

    async def go():
        src = random_caches(LAYOUT, 4, seed=2)
        source = TransferAgent(LAYOUT, src, TCP)
        await source.start()
        driver = await RemoteAgent.connect(address, TCP, on_release=lambda ids: None)
        handoff = source.offer("r", [0, 2])
        result = await driver.pull([handoff], [4, 5], timeout=10)
        assert result.num_sources == 1 and blocks_equal(src, [0, 2], dst, [4, 5])
        # the lease was used up by that pull: a second one is refused, typed
        with pytest.raises(LeaseExpired):
            await driver.pull([handoff], [1, 3], timeout=10)
        await driver.close()
        await source.close()

    try:
        run(go())
    finally:
        host.stop()


def test_cancel_and_refused_offers_end_their_leases_on_the_driver():
    host = AgentHost(random_caches(LAYOUT, 4, seed=3), tp_rank=0, tp_size=1)
    address = host.start("127.0.0.1")
    released = []

    async def go():
        driver = await RemoteAgent.connect(address, TCP, on_release=released.append)
        driver.offer("a", [0, 1])
        driver.offer("b", [9])  # past the host's 4 blocks: refused there
        assert driver.num_leases == 2 and driver.cancel("a") == 1
        for _ in range(100):
            if len(released) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(released) == [(0, 1), (9,)] and driver.num_leases == 0
        await driver.close()

    try:
        run(go())
    finally:
        host.stop()


def _host_process(conn) -> None:
    """A host in its own process, as a rank's: reports its address, then serves until killed."""
    import time

    host = AgentHost(zero_caches(LAYOUT, 4), tp_rank=0, tp_size=1)
    conn.send(host.start("127.0.0.1"))
    time.sleep(120)


def test_a_killed_host_fails_pulls_in_flight_and_ends_every_lease_once():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    process = ctx.Process(target=_host_process, args=(theirs,), daemon=True)
    process.start()
    released = []

    async def go():
        address = mine.recv()
        driver = await RemoteAgent.connect(address, TCP, on_release=released.append)
        driver.offer("a", [0, 1])
        # a pull from a source that never answers: in flight when the host dies
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = silent.sockets[0].getsockname()[1]
        stuck = dataclasses.replace(driver.offer("x", [2]), address=f"tcp://127.0.0.1:{port}")
        pull = asyncio.ensure_future(driver.pull([stuck], [3], timeout=30))
        await asyncio.sleep(0.2)
        process.kill()
        with pytest.raises(PeerGone):
            await asyncio.wait_for(pull, 10)
        assert sorted(released) == [(0, 1), (2,)] and driver.num_leases == 0
        with pytest.raises(PeerGone):
            driver.offer("b", [0])
        silent.close()
        await driver.close()
        assert len(released) == 2

    try:
        run(go())
    finally:
        process.kill()
        process.join(5)


def test_a_driver_without_the_token_is_refused():
    host = AgentHost(zero_caches(LAYOUT, 4), tp_rank=0, tp_size=1)
    address = host.start("127.0.0.1")

    async def go():
        with pytest.raises(PeerGone):
            await RemoteAgent.connect(dataclasses.replace(address, token=b"x" * 16), TCP,
                                      on_release=lambda ids: None, timeout_s=5)

    try:
        run(go())
    finally:
        host.stop()
