"""Calls over one socket between the router's process and a worker's: a call is (call id,
method, args), its answer (call id, ok, value or exception), each framed by
`cluster.process_wire`; many calls run at once and are answered in any order.

Two channels use it, both a `SocketChannel`: `cluster.process_worker` (a worker in a process of
its own) and the Ray path's data channel (`cluster.worker_client`: the engine actor serves its
worker on a socket of its own, so the router's message per engine step is one framed pickle on a
long-lived connection, not a Ray actor call). A worker's channel has two methods: "call", whose
one argument is a call record (`workers.contract.calls`), and "next_outputs", the output
channel's long poll (`serve_channel`). The caller proves itself first with a random token it got
by a trusted way (the spawning parent, or a Ray call to the actor).
"""

from __future__ import annotations

import abc
import asyncio
import hmac
import itertools
import logging
import pickle
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from cluster import process_wire as wire
from router.errors import WorkerUnavailableError
from router.worker_client import WorkerChannel
from workers.contract.calls import Call
from workers.contract.messages import WorkerOutputs

logger = logging.getLogger(__name__)

TOKEN_BYTES = 32

Handler = Callable[[str, tuple], Awaitable[object]]
CHANNEL_METHODS = frozenset({"call", "next_outputs"})  # what a worker's socket serves
R = TypeVar("R")


class SocketCalls:
    """The caller's end of one connection. A lost connection fails every call in flight, and
    every later one, with `WorkerUnavailableError`."""

    def __init__(self, worker_id: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.worker_id = worker_id
        self._writer = writer
        self._pending: dict[int, asyncio.Future[object]] = {}
        self._ids = itertools.count()
        self.lost: str | None = None  # why the connection is gone
        self._reader = asyncio.get_running_loop().create_task(self._read(reader))

    @classmethod
    async def connect(cls, worker_id: str, host: str, port: int, token: bytes,
                      timeout_s: float) -> SocketCalls:
        """A connection to a server of `serve_calls`, proven by `token`."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    timeout_s)
        except (TimeoutError, OSError) as exc:
            raise WorkerUnavailableError(worker_id, f"cannot reach its channel at "
                                                    f"{host}:{port}: {exc!r}") from None
        wire.no_delay(writer.get_extra_info("socket"))
        writer.write(token)
        return cls(worker_id, reader, writer)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, ok, value = await wire.read(reader)
                future = self._pending.pop(call_id, None)
                if future is not None and not future.done():
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._fail_all(f"its connection closed ({type(exc).__name__})")
        except Exception as exc:  # a message that does not decode
            logger.exception("worker %s sent a message that does not decode", self.worker_id)
            self._fail_all(f"it sent a message that does not decode: {exc!r}")

    def _fail_all(self, why: str) -> None:
        self.lost = self.lost or why
        for future in self._pending.values():
            if not future.done():
                future.set_exception(WorkerUnavailableError(self.worker_id, why))
        self._pending.clear()

    async def call(self, method: str, *args: object) -> Any:
        if self.lost is not None:
            raise WorkerUnavailableError(self.worker_id, self.lost)
        call_id = next(self._ids)
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            self._writer.write(wire.frame((call_id, method, args)))
        except (ConnectionError, OSError, RuntimeError) as exc:
            self._pending.pop(call_id, None)
            raise WorkerUnavailableError(self.worker_id, f"cannot reach it: {exc}") from None
        try:
            return await future
        finally:
            self._pending.pop(call_id, None)  # a caller that gave up leaves nothing behind

    def close(self, why: str = "the channel was closed") -> None:
        self._fail_all(why)
        self._writer.close()
        self._reader.cancel()


async def serve_calls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      handler: Handler, last: frozenset[str] = frozenset()) -> None:
    """Answer calls until the caller closes the connection: each by `handler(method, args)`
    as its own task; after answering a method in `last` the connection is closed."""
    tasks: set[asyncio.Task[None]] = set()

    async def answer(call_id: int, method: str, args: tuple) -> None:
        try:
            reply = (call_id, True, await handler(method, args))
        except Exception as exc:  # noqa: BLE001 - the caller raises it
            reply = (call_id, False, transportable(exc))
        if writer.is_closing():
            return
        writer.write(wire.frame(reply))
        if method in last:
            await writer.drain()
            writer.close()

    try:
        while True:
            call_id, method, args = await wire.read(reader)
            task = asyncio.get_running_loop().create_task(answer(call_id, method, args))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass  # the caller closed the connection (or went away)
    finally:
        for task in tasks:
            task.cancel()
        writer.close()


class CallServer:
    """A listening socket whose every connection, once it has sent the token, is answered by
    `serve_calls`; connections that send anything else are closed unanswered."""

    def __init__(self, handler: Handler, methods: frozenset[str]) -> None:
        """`methods`: the only ones a caller may call (any other is refused)."""
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._handler = handler
        self._methods = methods
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str) -> CallServer:
        self._server = await asyncio.start_server(self._accept, host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), 10.0)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            writer.close()
            return
        if not hmac.compare_digest(token, self.token):
            logger.warning("a connection to the worker's channel sent a wrong token; closed")
            writer.close()
            return
        wire.no_delay(writer.get_extra_info("socket"))
        await serve_calls(reader, writer, self._checked)

    async def _checked(self, method: str, args: tuple) -> object:
        if method not in self._methods:
            raise ValueError(f"method {method!r} is not served on this channel; expected one "
                             f"of {sorted(self._methods)}")
        return await self._handler(method, args)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def transportable(exc: Exception) -> Exception:
    """`exc`, or a RuntimeError saying it where it would not survive pickling both ways."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure to travel
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class SocketChannel(WorkerChannel):
    """A `WorkerChannel` whose records go over a `SocketCalls` connection to a server of
    `serve_channel`; a subclass says how it connects."""

    @abc.abstractmethod
    async def _connection(self) -> SocketCalls:
        """The open connection (made or remade here); raises `WorkerUnavailableError`."""

    async def call(self, call: Call[R]) -> R:
        return await (await self._connection()).call("call", call)

    async def next_outputs(self, subscriber: str, timeout_s: float,
                           min_interval_s: float = 0.0) -> WorkerOutputs:
        return await (await self._connection()).call("next_outputs", subscriber, timeout_s,
                                                     min_interval_s)


def serve_channel(channel: WorkerChannel) -> Handler:
    """The answers of a worker's socket (`CHANNEL_METHODS`), from the worker's own channel
    (`cluster.inprocess_client.InProcessChannel`)."""
    async def handle(method: str, args: tuple) -> object:
        if method == "call":
            return await channel.call(args[0])
        if method == "next_outputs":
            return await channel.next_outputs(*args)
        raise ValueError(f"method {method!r} is not served on a worker's channel; expected "
                         f"one of {sorted(CHANNEL_METHODS)}")

    return handle
