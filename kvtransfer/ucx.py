"""`ucx` transport over UCXX (PyPI `ucxx-cu12`, imported only when this transport is built).

UCX picks the wire itself: on one node host memory moves by CMA zero-copy (the puller reads
the source's pages with `process_vm_readv`, one copy), GPU memory through CUDA IPC; across nodes
RDMA where present, else TCP. Each view (K or V of a coalesced segment, per layer) is one tagged
message sent from and received into tensor memory, with up to `ucx_endpoint.LAYERS_IN_FLIGHT`
layers of messages posted at once on both sides (`ucx_endpoint` also says how requests are
waited for); control messages are a 13-byte header then a JSON body, in the order described in
`wire`.
Address: `ucx://HOST:PORT`. Opening an endpoint (UCXX connect, wire-up and peer-info exchange)
takes 0.15 to 0.6 s on a 2-core host, more than a 1 GiB pull on one node, so the puller keeps one
endpoint per source address and reuses it for later pulls, one pull at a time (an `asyncio.Lock`
per address: messages of two pulls never interleave on one endpoint). Any error or cancellation
drops the endpoint, and the next pull reconnects. The source serves request after request on each
endpoint until the peer closes it.

UCX settings (`UCX_DEFAULTS`), set in the environment when the transport is built unless the
user already set them; they take effect only if no UCX context exists yet in the process:

- `UCX_CMA_MEMORY_INVALIDATE=y`: UCXX endpoints always use peer error handling, and UCX then
  admits a rendezvous zero-copy lane only if its memory domain advertises RMA invalidation.
  CMA's does so only with this flag; without it every byte on one node went through loopback TCP
  ("rendezvous fragmented copy-in copy-out | tcp/lo", about 0.1 of memcpy). The flag only
  advertises the capability (UCX cannot revoke a peer's access), which is safe here because the
  puller reads: the source's memory is never written, and a failed pull closes its endpoint
  and waits for its receives before returning, so nothing writes into its blocks afterwards.

- `UCX_CMA_SEG_SIZE=16M`: the largest read one `process_vm_readv` makes (default 512 KiB). A
  view of a 1 GiB pull is 16 MiB; one call per view instead of 32 took CMA from about 3.3 to
  4.6 GB/s on a 2-core host (memcpy about 11).

Control messages stay on TCP: `UCX_MM_ERROR_HANDLING=y` would move them to sysv/posix shared
memory, but those detect a dead peer only by keepalive, so a killed puller held its lease for
longer than the tests allow; TCP notices at once, and the control traffic is a few hundred bytes.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any
from collections.abc import Coroutine

import torch

from kvtransfer.control import CONNECTION_TIMEOUT_S, open_read, parse_address
from kvtransfer.errors import (InvalidDescriptor, LayoutMismatch, PeerGone, TransferError,
                               TransportUnavailable)
from kvtransfer.transport import (BlockSource, LayerSink, TransferStats, Transport,
                                  TransportConfig)
from kvtransfer.ucx_endpoint import Endpoint, Pipeline
from kvtransfer.wire import ReadAccepted, ReadDone, ReadRejected, ReadRequest

UCX_DEFAULTS = {
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    "UCX_CMA_SEG_SIZE": "16M",
}


def _import_ucxx() -> Any:
    for name, value in UCX_DEFAULTS.items():
        os.environ.setdefault(name, value)
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


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._ucxx = _import_ucxx()
        self._host, self._port = host, port
        self._source: BlockSource | None = None
        self._listener: Any = None
        self._endpoints: dict[str, Endpoint] = {}  # puller: one per source address
        self._locks: dict[str, asyncio.Lock] = {}  # puller: held by the pull using the endpoint
        self._served: set[Endpoint] = set()  # source: endpoints pullers opened to us

    @classmethod
    def from_config(cls, config: TransportConfig, hub: object | None = None) -> UcxTransport:
        return cls(config.host, config.port)

    async def start(self, source: BlockSource) -> str:
        self._source = source
        self._listener = self._ucxx.create_listener(self._serve, self._port or None)
        return f"ucx://{self._host}:{self._listener.port}"

    async def _serve(self, raw_ep: Any) -> None:
        """Serve one puller's endpoint: pull after pull, until the peer closes it or a pull
        fails (the puller then drops the endpoint)."""
        ep = Endpoint(self._ucxx, raw_ep)
        self._served.add(ep)
        try:
            while await self._serve_one(ep):
                pass
        finally:
            self._served.discard(ep)
            await ep.close()

    async def _serve_one(self, ep: Endpoint) -> bool:
        """One pull on `ep`; True when it ended cleanly and the endpoint may carry the next."""
        source = self._source
        if source is None:
            raise RuntimeError("the transport serves only after start()")
        sends = Pipeline()
        read = None
        try:
            request = await ep.recv_message()  # PeerGone here: the puller closed the endpoint
            if not isinstance(request, ReadRequest):
                raise InvalidDescriptor(f"expected a ReadRequest, got {type(request).__name__}")
            try:
                read = await open_read(source, request)
            except TransferError as e:
                await ep.send_message(ReadRejected.of(e))
                return True
            await ep.send_message(ReadAccepted(read.bytes_per_layer))
            await sends.run(read.num_layers, lambda layer: [
                ep.send(_buffer(view.contiguous())) for view in read.layer_views(layer)],
                lambda layer: None)
            # a puller that never confirms must not hold the lease's blocks
            done = await asyncio.wait_for(ep.recv_message(), CONNECTION_TIMEOUT_S)
            if not isinstance(done, ReadDone):
                raise InvalidDescriptor("expected ReadDone after the last layer")
            return True
        except (TimeoutError, TransferError):
            return False  # the puller sees its own error (or stopped); the read ends below
        finally:
            if read is not None:
                if not sends.idle:
                    await ep.close()  # cancels the sends still in flight
                await sends.settle()
                source.close_read(read)

    async def fetch(self, address: str, request: ReadRequest, sink: LayerSink) -> TransferStats:
        start = time.perf_counter()
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:  # one pull at a time on the cached endpoint
            ep = await self._endpoint(address)
            receives = Pipeline()
            try:
                messages = await self._receive(ep, request, sink, receives)
            except BaseException:  # also cancellation: the endpoint may carry stray messages
                if self._endpoints.get(address) is ep:
                    del self._endpoints[address]
                await ep.close()
                await receives.settle()
                raise
        return TransferStats(sink.bytes_per_layer * sink.num_layers, messages,
                             time.perf_counter() - start)

    async def _endpoint(self, address: str) -> Endpoint:
        """The cached endpoint to `address`, or a new one when none is cached or it closed."""
        ep = self._endpoints.get(address)
        if ep is not None and not ep.ep.closed:
            return ep
        host, port = parse_address(address, "ucx")
        try:
            raw_ep = await self._ucxx.create_endpoint(host, port)
        except self._ucxx.exceptions.UCXError as e:
            raise PeerGone(f"cannot connect to {address}: {e!r}") from None
        ep = self._endpoints[address] = Endpoint(self._ucxx, raw_ep)
        return ep

    @staticmethod
    async def _receive(ep: Endpoint, request: ReadRequest, sink: LayerSink,
                       receives: Pipeline) -> int:
        """One pull's messages on `ep`; returns the number of data messages."""
        staged: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer: (view, staging)

        def post(layer: int) -> list[Coroutine]:
            pairs = [(view, view if view.is_contiguous() else torch.empty(
                view.shape, dtype=view.dtype, device=view.device))
                for view in sink.layer_views(layer)]
            staged[layer] = pairs
            return [ep.recv(_buffer(buf)) for _, buf in pairs]

        def land(layer: int) -> None:
            for view, buf in staged.pop(layer):
                if buf is not view:
                    view.copy_(buf)
            sink.landed(layer)

        await ep.send_message(request)
        reply = await ep.recv_message()
        if isinstance(reply, ReadRejected):
            raise reply.error()
        if not isinstance(reply, ReadAccepted) or reply.bytes_per_layer != sink.bytes_per_layer:
            raise LayoutMismatch(f"source replied {reply}; expected ReadAccepted of "
                                 f"{sink.bytes_per_layer} bytes per layer")
        messages = await receives.run(sink.num_layers, post, land)
        await ep.send_message(ReadDone())
        return messages

    async def close(self) -> None:
        """Stop listening and close every endpoint, cached (puller) and served (source)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        endpoints = [*self._endpoints.values(), *self._served]
        self._endpoints.clear()
        for ep in endpoints:
            await ep.close()
