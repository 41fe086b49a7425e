"""`ucx` transport over UCXX (PyPI `ucxx-cu12`, imported only when this transport is built).

UCX picks the wire itself: on one node host memory moves by CMA zero-copy (the puller reads
the source's pages with `process_vm_readv`, one copy), GPU memory through CUDA IPC; across nodes RDMA where present, else TCP. Each view
(K or V of a coalesced segment, per layer) is one tagged message sent from and received into
tensor memory, with up to `LAYERS_IN_FLIGHT` layers of messages posted at once on both sides;
control messages are a 13-byte header then a JSON body, in the order described in `wire`.
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

Waiting on a request polls it (`_unspun`): UCXX's own wait spins the event loop, and one spinning
thread per process left CMA a fraction of a core. With the loop idle between polls, a 1 GiB pull
on a 2-core host is one `process_vm_readv` thread at about 4.6 GB/s (0.40 to 0.47 of the two-thread
memcpy bound with 4 KiB pages; 6 to 6.6 GB/s, 0.57 to 0.6, when both caches are on huge pages,
whose pages CMA pins faster). A second reader thread would need a second UCX worker, which
UCXX's public API does not offer (one context and worker per process).

Control messages stay on TCP: `UCX_MM_ERROR_HANDLING=y` would move them to sysv/posix shared
memory, but those detect a dead peer only by keepalive, so a killed puller held its lease for
longer than the tests allow; TCP notices at once, and the control traffic is a few hundred bytes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import Any, Callable, Coroutine, Iterable

import numpy as np
import torch

from kvtransfer.errors import (InvalidDescriptor, LayoutMismatch, PeerGone, TransferError,
                               TransportUnavailable, error_from_kind)
from kvtransfer.control import parse_address
from kvtransfer.transport import (BlockSource, LayerSink, TransferStats, Transport,
                                  TransportConfig)
from kvtransfer.wire import (HEADER, Message, ReadAccepted, ReadDone, ReadRejected, ReadRequest,
                             decode, encode)


UCX_DEFAULTS = {
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    "UCX_CMA_SEG_SIZE": "16M",
}
LAYERS_IN_FLIGHT = 4  # layers whose messages are posted ahead of the oldest one not yet done
SPIN_POLLS = 32  # polls of a UCX request back to back before sleeping between polls
POLL_INTERVAL_S = 0.0005  # then this long between polls (the event loop rounds it up to 1 ms)


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


async def _unspun(coro: Coroutine) -> Any:
    """Await `coro`, a UCXX send or receive, without letting it spin. With its notifier thread
    off (the default, and the only mode that works across event loops) UCXX waits for a request
    by `await asyncio.sleep(0)` in a loop: a busy core per process while any request is pending,
    an idle source waiting for the next pull included, and on a 2-core host the CMA reads got
    a third of a core. Each such bare yield is answered here by an immediate poll for the first
    `SPIN_POLLS`, then by a sleep of `POLL_INTERVAL_S`; a future it yields is waited for as a
    task would. Cancelling the caller throws into `coro`, as it would into a task's."""
    polls, error = 0, None
    try:
        while True:
            try:
                yielded = coro.throw(error) if error is not None else coro.send(None)
            except StopIteration as stop:
                return stop.value
            error = None
            try:
                if yielded is not None:  # `coro` reads the future's outcome itself
                    await asyncio.wait([yielded])
                    continue
                polls += 1
                await asyncio.sleep(0 if polls <= SPIN_POLLS else POLL_INTERVAL_S)
            except asyncio.CancelledError as e:
                if yielded is not None:
                    yielded.cancel()
                error = e
    finally:
        coro.close()


class _Pipeline:
    """Posts each layer's messages while up to `LAYERS_IN_FLIGHT` earlier layers are still
    moving, so UCX always has the next rendezvous posted. Messages are posted in plan order (one
    endpoint, one tag: UCX matches them in that order)."""

    def __init__(self) -> None:
        self._posted: list[asyncio.Future] = []

    async def run(self, num_layers: int, post: Callable[[int], Iterable[Coroutine]],
                  done: Callable[[int], None]) -> int:
        """`post(layer)` gives the layer's send or receive coroutines; `done(layer)` runs in
        layer order once all of them completed. Returns the number of messages; raises the
        first message's error."""
        window: deque[tuple[int, list[asyncio.Future]]] = deque()
        messages = 0
        for layer in range(num_layers):
            ops = [asyncio.ensure_future(op) for op in post(layer)]
            self._posted.extend(ops)
            window.append((layer, ops))
            while window and (len(window) > LAYERS_IN_FLIGHT or layer == num_layers - 1):
                oldest, ops = window.popleft()
                await asyncio.wait(ops)  # unlike gather, a cancelled pull leaves them to settle
                for op in ops:
                    op.result()
                messages += len(ops)
                done(oldest)
        return messages

    @property
    def idle(self) -> bool:
        """Whether every posted message has ended."""
        return all(op.done() for op in self._posted)

    async def settle(self) -> None:
        """Wait for every posted message to end; call after closing the endpoint, which makes
        UCX cancel those still in flight. Afterwards nothing reads or writes their buffers."""
        await asyncio.gather(*self._posted, return_exceptions=True)


class _Endpoint:
    """A UCXX endpoint that speaks `wire` messages and raises `PeerGone` for UCX failures."""

    def __init__(self, ucxx: Any, ep: Any) -> None:
        self._errors = (ucxx.exceptions.UCXError,)
        self.ep = ep

    async def send(self, buf: Any) -> None:
        try:
            await _unspun(self.ep.send(buf))
        except self._errors as e:
            raise PeerGone(f"UCX send failed: {e!r}") from None

    async def recv(self, buf: Any) -> None:
        try:
            await _unspun(self.ep.recv(buf))
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
        self._endpoints: dict[str, _Endpoint] = {}  # puller: one per source address
        self._locks: dict[str, asyncio.Lock] = {}  # puller: held by the pull using the endpoint
        self._served: set[_Endpoint] = set()  # source: endpoints pullers opened to us

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
        ep = _Endpoint(self._ucxx, raw_ep)
        self._served.add(ep)
        try:
            while await self._serve_one(ep):
                pass
        finally:
            self._served.discard(ep)
            await ep.close()

    async def _serve_one(self, ep: _Endpoint) -> bool:
        """One pull on `ep`; True when it ended cleanly and the endpoint may carry the next."""
        sends = _Pipeline()
        read = None
        try:
            request = await ep.recv_message()  # PeerGone here: the puller closed the endpoint
            if not isinstance(request, ReadRequest):
                raise InvalidDescriptor(f"expected a ReadRequest, got {type(request).__name__}")
            try:
                read = self._source.open_read(request)
            except TransferError as e:
                await ep.send_message(ReadRejected(e.kind, str(e)))
                return True
            await ep.send_message(ReadAccepted(read.bytes_per_layer))
            await sends.run(read.num_layers, lambda layer: [
                ep.send(_buffer(view.contiguous())) for view in read.layer_views(layer)],
                lambda layer: None)
            if not isinstance(await ep.recv_message(), ReadDone):
                raise InvalidDescriptor("expected ReadDone after the last layer")
            return True
        except TransferError:
            return False  # the puller sees its own error; the read ends below
        finally:
            if read is not None:
                if not sends.idle:
                    await ep.close()  # cancels the sends still in flight
                await sends.settle()
                self._source.close_read(read)

    async def fetch(self, address: str, request: ReadRequest, sink: LayerSink) -> TransferStats:
        start = time.perf_counter()
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:  # one pull at a time on the cached endpoint
            ep = await self._endpoint(address)
            receives = _Pipeline()
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

    async def _endpoint(self, address: str) -> _Endpoint:
        """The cached endpoint to `address`, or a new one when none is cached or it closed."""
        ep = self._endpoints.get(address)
        if ep is not None and not ep.ep.closed:
            return ep
        host, port = parse_address(address, "ucx")
        try:
            raw_ep = await self._ucxx.create_endpoint(host, port)
        except self._ucxx.exceptions.UCXError as e:
            raise PeerGone(f"cannot connect to {address}: {e!r}") from None
        ep = self._endpoints[address] = _Endpoint(self._ucxx, raw_ep)
        return ep

    @staticmethod
    async def _receive(ep: _Endpoint, request: ReadRequest, sink: LayerSink,
                       receives: _Pipeline) -> int:
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
            raise error_from_kind(reply.kind, reply.message)
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
