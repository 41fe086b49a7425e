"""`ucx` transport over UCXX (PyPI `ucxx-cu12`, imported only when this transport is built).

UCX picks the wire itself: on one node host memory moves through shared memory (posix/sysv, or
CMA zero-copy for large messages), GPU memory through CUDA IPC; across nodes RDMA where present,
else TCP. Each view (K or V of a coalesced segment, per layer) is one tagged message sent from
and received into tensor memory; control messages are a 13-byte header then a JSON body, in the
order described in `wire`. Address: `ucx://HOST:PORT`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from kvtransfer.errors import (InvalidDescriptor, LayoutMismatch, PeerGone, TransferError,
                               TransportUnavailable, error_from_kind)
from kvtransfer.tcp import parse_address
from kvtransfer.transport import BlockSource, LayerSink, TransferStats, Transport
from kvtransfer.wire import (HEADER, Message, ReadAccepted, ReadDone, ReadRejected, ReadRequest,
                             decode, encode)


def _import_ucxx() -> Any:
    try:
        import ucxx
    except ImportError as e:
        raise TransportUnavailable(
            f"the ucx transport needs the `ucxx` package (pip install ucxx-cu12): {e}") from None
    return ucxx


def _buffer(t: torch.Tensor) -> Any:
    """What UCXX sends from / receives into without a copy: a uint8 view of contiguous memory."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()  # CUDA tensors expose __cuda_array_interface__


class _Endpoint:
    """A UCXX endpoint that speaks `wire` messages and raises `PeerGone` for UCX failures."""

    def __init__(self, ucxx: Any, ep: Any) -> None:
        self._errors = (ucxx.exceptions.UCXError,)
        self.ep = ep

    async def send(self, buf: Any) -> None:
        try:
            await self.ep.send(buf)
        except self._errors as e:
            raise PeerGone(f"UCX send failed: {e!r}") from None

    async def recv(self, buf: Any) -> None:
        try:
            await self.ep.recv(buf)
        except self._errors as e:
            raise PeerGone(f"UCX receive failed: {e!r}") from None

    async def send_message(self, msg: Message) -> None:
        kind, payload = encode(msg)
        await self.send(np.frombuffer(bytearray(HEADER.pack(kind, 0, len(payload))), np.uint8))
        await self.send(np.frombuffer(bytearray(payload), np.uint8))

    async def recv_message(self) -> Message:
        header = np.empty(HEADER.size, np.uint8)
        await self.recv(header)
        kind, _, length = HEADER.unpack(header.tobytes())
        if length > 1 << 24:
            raise InvalidDescriptor(f"control message of {length} bytes; expected < 16 MiB")
        body = np.empty(length, np.uint8)
        await self.recv(body)
        return decode(kind, body.tobytes())

    async def close(self) -> None:
        try:
            await self.ep.close()
        except self._errors:
            pass


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._ucxx = _import_ucxx()
        self._host, self._port = host, port
        self._source: BlockSource | None = None
        self._listener: Any = None

    async def start(self, source: BlockSource) -> str:
        self._source = source
        self._listener = self._ucxx.create_listener(self._serve, self._port or None)
        return f"ucx://{self._host}:{self._listener.port}"

    async def _serve(self, raw_ep: Any) -> None:
        ep = _Endpoint(self._ucxx, raw_ep)
        read = None
        try:
            request = await ep.recv_message()
            if not isinstance(request, ReadRequest):
                raise InvalidDescriptor(f"expected a ReadRequest, got {type(request).__name__}")
            try:
                read = self._source.open_read(request)
            except TransferError as e:
                await ep.send_message(ReadRejected(e.kind, str(e)))
                return
            await ep.send_message(ReadAccepted(read.bytes_per_layer))
            for layer in range(read.num_layers):
                for view in read.layer_views(layer):
                    await ep.send(_buffer(view.contiguous()))
            if not isinstance(await ep.recv_message(), ReadDone):
                raise InvalidDescriptor("expected ReadDone after the last layer")
        except TransferError:
            pass  # the puller sees its own error; the read ends below
        finally:
            if read is not None:
                self._source.close_read(read)
            await ep.close()

    async def fetch(self, address: str, request: ReadRequest, sink: LayerSink) -> TransferStats:
        start = time.perf_counter()
        host, port = parse_address(address, "ucx")
        try:
            raw_ep = await self._ucxx.create_endpoint(host, port)
        except self._ucxx.exceptions.UCXError as e:
            raise PeerGone(f"cannot connect to {address}: {e!r}") from None
        ep = _Endpoint(self._ucxx, raw_ep)
        messages = 0
        try:
            await ep.send_message(request)
            reply = await ep.recv_message()
            if isinstance(reply, ReadRejected):
                raise error_from_kind(reply.kind, reply.message)
            if not isinstance(reply, ReadAccepted) or reply.bytes_per_layer != sink.bytes_per_layer:
                raise LayoutMismatch(f"source replied {reply}; expected ReadAccepted of "
                                     f"{sink.bytes_per_layer} bytes per layer")
            for layer in range(sink.num_layers):
                for view in sink.layer_views(layer):
                    staged = view if view.is_contiguous() else torch.empty(
                        view.shape, dtype=view.dtype, device=view.device)
                    await ep.recv(_buffer(staged))
                    if staged is not view:
                        view.copy_(staged)
                    messages += 1
                sink.landed(layer)
            await ep.send_message(ReadDone())
        finally:
            await ep.close()
        return TransferStats(sink.bytes_per_layer * sink.num_layers, messages,
                             time.perf_counter() - start)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
