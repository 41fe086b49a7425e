"""`cluster.socket_calls`: the router's calls to a worker over one socket (a worker process's
channel, and the engine actor's data channel on Ray), on real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from cluster.socket_calls import CallServer, SocketCalls
from router.errors import WorkerUnavailableError


class _Worker:
    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def handle(self, method: str, args: tuple) -> object:
        if method == "slow":
            await self.release.wait()
            return "slow done"
        if method == "echo":
            return args
        if method == "fail":
            raise ValueError(f"bad value {args[0]!r}: expected a positive count")
        raise AssertionError(method)


async def _served(methods=("slow", "echo", "fail")) -> tuple[_Worker, CallServer]:
    worker = _Worker()
    server = await CallServer(worker.handle, frozenset(methods)).start("127.0.0.1")
    return worker, server


def test_calls_run_at_once_and_are_answered_in_any_order():
    async def main():
        worker, server = await _served()
        calls = await SocketCalls.connect("w0", "127.0.0.1", server.port, server.token, 5)
        slow = asyncio.ensure_future(calls.call("slow"))
        assert await asyncio.wait_for(calls.call("echo", 1, [2, 3]), 5) == (1, [2, 3])
        assert not slow.done()  # a long poll does not hold the calls behind it
        worker.release.set()
        assert await asyncio.wait_for(slow, 5) == "slow done"
        calls.close()
        await server.stop()

    asyncio.run(main())


def test_the_workers_exception_is_raised_as_it_raised_it_and_others_are_refused():
    async def main():
        _, server = await _served(methods=("echo", "fail"))
        calls = await SocketCalls.connect("w0", "127.0.0.1", server.port, server.token, 5)
        with pytest.raises(ValueError, match="bad value -1: expected a positive count"):
            await calls.call("fail", -1)
        with pytest.raises(ValueError, match="'shutdown' is not served on this channel"):
            await calls.call("shutdown")
        assert await calls.call("echo", "still fine") == ("still fine",)
        calls.close()
        await server.stop()

    asyncio.run(main())


def test_a_wrong_token_gets_no_answer_and_the_worker_counts_as_unavailable():
    async def main():
        _, server = await _served()
        calls = await SocketCalls.connect("w0", "127.0.0.1", server.port, b"x" * 32, 5)
        with pytest.raises(WorkerUnavailableError, match="w0.*connection closed"):
            await asyncio.wait_for(calls.call("echo", 1), 5)
        await server.stop()

    asyncio.run(main())


def test_a_lost_connection_fails_the_call_in_flight_and_every_later_one():
    async def main():
        worker, server = await _served()
        calls = await SocketCalls.connect("w0", "127.0.0.1", server.port, server.token, 5)
        slow = asyncio.ensure_future(calls.call("slow"))
        await asyncio.sleep(0.05)
        calls._writer.transport.abort()  # the peer's end goes away mid-call
        with pytest.raises(WorkerUnavailableError, match="w0"):
            await asyncio.wait_for(slow, 5)
        with pytest.raises(WorkerUnavailableError, match="w0"):
            await calls.call("echo", 1)
        assert calls.lost is not None
        worker.release.set()
        await server.stop()

    asyncio.run(main())


def test_a_caller_that_gives_up_leaves_nothing_pending():
    async def main():
        worker, server = await _served()
        calls = await SocketCalls.connect("w0", "127.0.0.1", server.port, server.token, 5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(calls.call("slow"), 0.1)
        assert calls._pending == {}
        worker.release.set()  # its late answer is dropped
        assert await calls.call("echo", 2) == (2,)
        calls.close()
        await server.stop()

    asyncio.run(main())


def test_nothing_listens_there_is_a_clear_unavailable_error():
    async def main():
        _, server = await _served()
        port = server.port
        await server.stop()
        with pytest.raises(WorkerUnavailableError, match=f"cannot reach its channel at "
                                                         f"127.0.0.1:{port}"):
            await SocketCalls.connect("w0", "127.0.0.1", port, server.token, 5)

    asyncio.run(main())
