"""TCP transport: asyncio over non-blocking sockets, works anywhere.

Sends straight from tensor memory (`sock_sendall` of a byte view) and receives straight into the
destination blocks (`sock_recv_into`) whenever the view is contiguous, which it is unless heads
are resharded; then one staging copy on each side. One frame per layer (see `wire`).
GPU caches are staged through host memory.
"""

from __future__ import annotations

import socket
import time

import torch

from kvtransfer import faults
from kvtransfer.control import (StreamServer, connect, open_read_or_reject, parse_address,
                                request_read)
from kvtransfer.errors import InvalidDescriptor
from kvtransfer.transport import (BlockSource, LayerSink, TransferStats, Transport, TransportConfig,
                                  as_bytes)
from kvtransfer.wire import (MessageKind, ReadDone, ReadRequest, recv_exact, recv_header,
                             recv_message, send_all, send_header, send_message)


def host_view(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its bytes can be sent in place, else a contiguous host copy."""
    return t if t.is_contiguous() and t.device.type == "cpu" else t.contiguous().cpu()


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host, self._port = host, port
        self._source: BlockSource | None = None
        self._server: StreamServer | None = None

    @classmethod
    def from_config(cls, config: TransportConfig, hub: object | None = None) -> TcpTransport:
        return cls(config.host, config.port)

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
                if layer == 0:
                    await faults.ahit("kv.serve")  # mid-transfer
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
