"""TCP transport: asyncio over non-blocking sockets, works anywhere.

Sends straight from tensor memory (`sock_sendall` of a byte view) and receives straight into the
destination blocks (`sock_recv_into`) whenever the view is contiguous, which it is unless heads
are resharded; then one staging copy on each side. One frame per layer (see `wire`).
GPU caches are staged through pinned host memory (`HostStaging`): one buffer per transfer in
flight, kept by the transport and reused by the next transfer, grown to the largest view it
carried; a CPU cache is never staged in it.
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


class HostStaging:
    """A reused host byte buffer through which a device tensor's bytes are sent or received,
    pinned when `pin` (default: when CUDA is available), so that device copies run at full
    speed and no host memory is allocated per view. Each view it hands out is valid until the
    next call; one transfer uses it at a time."""

    def __init__(self, pin: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self.allocations = 0  # times the buffer was (re)allocated

    def host(self, like: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor of `like`'s shape and dtype over the buffer (not filled)."""
        nbytes = like.numel() * like.element_size()
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
            self.allocations += 1
        return self._buffer[:nbytes].view(like.dtype).view(like.shape)

    def copy_out(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s values in the buffer; the copy has finished when this returns."""
        return self.host(t).copy_(t)


def host_view(t: torch.Tensor, staging: HostStaging | None = None) -> torch.Tensor:
    """`t` itself when its bytes can be sent in place (contiguous CPU memory); a device tensor
    copied into `staging` when given; else a contiguous host copy."""
    if t.device.type == "cpu":
        return t if t.is_contiguous() else t.contiguous()
    return t.contiguous().cpu() if staging is None else staging.copy_out(t)


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host, self._port = host, port
        self._source: BlockSource | None = None
        self._server: StreamServer | None = None
        self._staging: list[HostStaging] = []  # free buffers for device caches' transfers

    @classmethod
    def from_config(cls, config: TransportConfig, hub: object | None = None) -> TcpTransport:
        return cls(config.host, config.port)

    async def start(self, source: BlockSource) -> str:
        self._source = source
        self._server = StreamServer(self._host, self._port, self._serve)
        return f"tcp://{self._server.host}:{self._server.port}"

    async def _serve(self, conn: socket.socket) -> None:
        source = self._source
        if source is None:
            raise RuntimeError("the transport serves only after start()")
        read = await open_read_or_reject(conn, source)
        if read is None:
            return
        staging = self._staging.pop() if self._staging else HostStaging()
        try:
            for layer in range(read.num_layers):
                await send_header(conn, MessageKind.LAYER, layer, read.bytes_per_layer)
                for view in read.layer_views(layer):
                    await send_all(conn, as_bytes(host_view(view, staging)))
                if layer == 0:
                    await faults.ahit("kv.serve")  # mid-transfer
            if not isinstance(await recv_message(conn), ReadDone):
                raise InvalidDescriptor("expected ReadDone after the last layer")
        finally:
            self._staging.append(staging)
            source.close_read(read)

    async def fetch(self, address: str, request: ReadRequest, sink: LayerSink) -> TransferStats:
        start = time.perf_counter()
        sock = await connect(*parse_address(address, "tcp"))
        staging = self._staging.pop() if self._staging else HostStaging()
        try:
            await request_read(sock, request, sink)
            for layer in range(sink.num_layers):
                kind, index, length = await recv_header(sock)
                if kind != MessageKind.LAYER or index != layer or length != sink.bytes_per_layer:
                    raise InvalidDescriptor(f"expected layer {layer} of {sink.bytes_per_layer} "
                                            f"bytes, got kind {kind} layer {index} of {length}")
                for view in sink.layer_views(layer):
                    await recv_into_view(sock, view, staging)
                sink.landed(layer)
            await send_message(sock, ReadDone())
        finally:
            self._staging.append(staging)
            sock.close()
        return TransferStats(sink.bytes_per_layer * sink.num_layers, sink.num_layers,
                             time.perf_counter() - start)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None


async def recv_into_view(sock: socket.socket, view: torch.Tensor,
                         staging: HostStaging | None = None) -> None:
    """Receives `view`'s bytes: straight into contiguous CPU memory; through `staging` (when
    given) for a device tensor; else through a fresh host tensor. The view is written when this
    returns."""
    if view.is_contiguous() and view.device.type == "cpu":
        await recv_exact(sock, as_bytes(view))
        return
    if view.device.type != "cpu" and staging is not None:
        host = staging.host(view)
    else:
        host = torch.empty(view.shape, dtype=view.dtype)
    await recv_exact(sock, as_bytes(host))
    view.copy_(host)
