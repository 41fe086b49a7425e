"""TCP transport: asyncio over non-blocking sockets, works anywhere.

Sends straight from tensor memory (`sock_sendall` of a byte view) and receives straight into the
destination blocks (`sock_recv_into`) whenever the view is contiguous, which it is unless heads
are resharded; then one staging copy on each side. One frame per layer (see `wire`).
GPU caches are staged through host memory.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import torch

from kvtransfer.errors import (InvalidDescriptor, LayoutMismatch, PeerGone, TransferError,
                               error_from_kind)
from kvtransfer.transport import (BlockSource, LayerSink, SourceRead, TransferStats, Transport,
                                  as_bytes)
from kvtransfer.wire import (MessageKind, ReadAccepted, ReadDone, ReadRejected, ReadRequest,
                             recv_exact, recv_header, recv_message, send_all, send_header,
                             send_message)

logger = logging.getLogger(__name__)


def parse_address(address: str, scheme: str) -> tuple[str, int]:
    prefix = f"{scheme}://"
    host, _, port = address.removeprefix(prefix).rpartition(":")
    if not address.startswith(prefix) or not host or not port.isdigit():
        raise InvalidDescriptor(f"address {address!r}; expected {prefix}HOST:PORT")
    return host, int(port)


def host_view(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its bytes can be sent in place, else a contiguous host copy."""
    return t if t.is_contiguous() and t.device.type == "cpu" else t.contiguous().cpu()


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


class StreamServer:
    """Accepts connections on a listening socket and runs `handle(conn)` for each; `close()`
    cancels the handlers (their `finally` blocks run) and closes every socket."""

    def __init__(self, host: str, port: int, handle) -> None:
        self._handle = handle
        self._listener = socket.create_server((host, port))
        self._listener.setblocking(False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._tasks: set[asyncio.Task] = set()
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = loop.create_task(self._run(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, conn: socket.socket) -> None:
        try:
            await self._handle(conn)
        except TransferError as e:
            logger.info("pull ended early: %s", e)
        finally:
            conn.close()

    async def close(self) -> None:
        tasks = [self._accepting, *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._listener.close()


async def open_read_or_reject(conn: socket.socket, source: BlockSource) -> SourceRead | None:
    """Read the pull's request and open it, or send the rejection and return None."""
    request = await recv_message(conn)
    if not isinstance(request, ReadRequest):
        raise InvalidDescriptor(f"expected a ReadRequest, got {type(request).__name__}")
    try:
        read = source.open_read(request)
    except TransferError as e:
        await send_message(conn, ReadRejected(e.kind, str(e)))
        return None
    await send_message(conn, ReadAccepted(read.bytes_per_layer))
    return read


async def request_read(sock: socket.socket, request: ReadRequest, sink: LayerSink) -> None:
    """Send the pull's request; raise the source's rejection as its `TransferError` class."""
    await send_message(sock, request)
    reply = await recv_message(sock)
    if isinstance(reply, ReadRejected):
        raise error_from_kind(reply.kind, reply.message)
    if not isinstance(reply, ReadAccepted):
        raise InvalidDescriptor(f"expected ReadAccepted, got {type(reply).__name__}")
    if reply.bytes_per_layer != sink.bytes_per_layer:
        raise LayoutMismatch(f"source sends {reply.bytes_per_layer} bytes per layer; the "
                             f"destination expects {sink.bytes_per_layer}")


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host, self._port = host, port
        self._source: BlockSource | None = None
        self._server: StreamServer | None = None

    async def start(self, source: BlockSource) -> str:
        self._source = source
        self._server = StreamServer(self._host, self._port, self._serve)
        return f"tcp://{self._server.host}:{self._server.port}"

    async def _serve(self, conn: socket.socket) -> None:
        read = await open_read_or_reject(conn, self._source)
        if read is None:
            return
        try:
            for layer in range(read.num_layers):
                await send_header(conn, MessageKind.LAYER, layer, read.bytes_per_layer)
                for view in read.layer_views(layer):
                    await send_all(conn, as_bytes(host_view(view)))
            if not isinstance(await recv_message(conn), ReadDone):
                raise InvalidDescriptor("expected ReadDone after the last layer")
        finally:
            self._source.close_read(read)

    async def fetch(self, address: str, request: ReadRequest, sink: LayerSink) -> TransferStats:
        start = time.perf_counter()
        sock = await connect(*parse_address(address, "tcp"))
        try:
            await request_read(sock, request, sink)
            for layer in range(sink.num_layers):
                kind, index, length = await recv_header(sock)
                if kind != MessageKind.LAYER or index != layer or length != sink.bytes_per_layer:
                    raise InvalidDescriptor(f"expected layer {layer} of {sink.bytes_per_layer} "
                                            f"bytes, got kind {kind} layer {index} of {length}")
                for view in sink.layer_views(layer):
                    await recv_into_view(sock, view)
                sink.landed(layer)
            await send_message(sock, ReadDone())
        finally:
            sock.close()
        return TransferStats(sink.bytes_per_layer * sink.num_layers, sink.num_layers,
                             time.perf_counter() - start)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None


async def recv_into_view(sock: socket.socket, view: torch.Tensor) -> None:
    if view.is_contiguous() and view.device.type == "cpu":
        await recv_exact(sock, as_bytes(view))
        return
    staging = torch.empty(view.shape, dtype=view.dtype)
    await recv_exact(sock, as_bytes(staging))
    view.copy_(staging)
