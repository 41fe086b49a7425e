"""The control channel the socket transports share (`tcp`'s data connection, `nccl`'s control
socket, `ucx`'s addresses): address parsing, connecting, a listening server that runs one
handler per connection, and the request/accept-or-reject exchange that opens a pull (see `wire`
for the messages)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from kvtransfer.errors import (InvalidDescriptor, LayoutMismatch, LeaseExpired, PeerGone,
                               TransferError)
from kvtransfer.transport import BlockSource, LayerSink, SourceRead
from kvtransfer.wire import (ReadAccepted, ReadRejected, ReadRequest, recv_message,
                             send_message)

logger = logging.getLogger(__name__)


def parse_address(address: str, scheme: str) -> tuple[str, int]:
    prefix = f"{scheme}://"
    host, _, port = address.removeprefix(prefix).rpartition(":")
    if not address.startswith(prefix) or not host or not port.isdigit():
        raise InvalidDescriptor(f"address {address!r}; expected {prefix}HOST:PORT")
    return host, int(port)


async def connect(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except OSError as e:
        sock.close()
        raise PeerGone(f"cannot connect to {host}:{port}: {e}") from None
    return sock


# a connection serves one pull (or a pair's handshake): bounded in time, so a puller that stops
# reading or never sends ReadDone cannot hold a lease's blocks past this; and in number
CONNECTION_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 256


class StreamServer:
    """Accepts connections on a listening socket and runs `handle(conn)` for each; `close()`
    cancels the handlers (their `finally` blocks run) and closes every socket. A handler still
    running after `timeout_s` is cancelled (its read ends, so its lease can end); a connection
    beyond `max_connections` open is closed at once (the puller sees `PeerGone`)."""

    def __init__(self, host: str, port: int,
                 handle: Callable[[socket.socket], Awaitable[None]], *,
                 timeout_s: float = CONNECTION_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self._handle = handle
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._listener = socket.create_server((host, port))
        self._listener.setblocking(False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._tasks: set[asyncio.Task] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, peer = await loop.sock_accept(self._listener)
            if len(self._tasks) >= self.max_connections:
                logger.warning("refused a KV connection from %s: %d already open", peer,
                               len(self._tasks))
                conn.close()
                continue
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._run(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, conn: socket.socket) -> None:
        try:
            await asyncio.wait_for(self._handle(conn), self.timeout_s)
        except TransferError as e:
            logger.info("pull ended early: %s", e)
        except TimeoutError:
            logger.warning("a KV connection ran past %s s and was closed", self.timeout_s)
        finally:
            conn.close()

    async def close(self) -> None:
        tasks = [self._accepting, *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()


# How long a pull naming a lease its source does not hold waits for it: a remote driver
# (`kvtransfer.remote.RemoteAgent.offer`) returns the handoff before its host has read the
# offer, so a puller that is quick enough reaches the host first (seen once in a loaded test
# run); a lease that really ended is refused this much later.
LEASE_GRACE_S, LEASE_POLL_S = 0.1, 0.005


async def open_read(source: BlockSource, request: ReadRequest) -> SourceRead:
    """`source.open_read(request)`, retried for up to `LEASE_GRACE_S` while it names a lease
    the source does not hold (the source's loop reads its offers meanwhile)."""
    deadline = asyncio.get_running_loop().time() + LEASE_GRACE_S
    while True:
        try:
            return source.open_read(request)
        except LeaseExpired:
            if asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(LEASE_POLL_S)


async def open_read_or_reject(conn: socket.socket, source: BlockSource) -> SourceRead | None:
    """Read the pull's request and open it (`open_read`), or send the rejection and return
    None."""
    request = await recv_message(conn)
    if not isinstance(request, ReadRequest):
        raise InvalidDescriptor(f"expected a ReadRequest, got {type(request).__name__}")
    try:
        read = await open_read(source, request)
    except TransferError as e:
        await send_message(conn, ReadRejected.of(e))
        return None
    await send_message(conn, ReadAccepted(read.bytes_per_layer))
    return read


async def request_read(sock: socket.socket, request: ReadRequest, sink: LayerSink) -> None:
    """Send the pull's request; raise the source's rejection as its `TransferError` class."""
    await send_message(sock, request)
    reply = await recv_message(sock)
    if isinstance(reply, ReadRejected):
        raise reply.error()
    if not isinstance(reply, ReadAccepted):
        raise InvalidDescriptor(f"expected ReadAccepted, got {type(reply).__name__}")
    if reply.bytes_per_layer != sink.bytes_per_layer:
        raise LayoutMismatch(f"source sends {reply.bytes_per_layer} bytes per layer; the "
                             f"destination expects {sink.bytes_per_layer}")
