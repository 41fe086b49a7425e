"""Same-process transport: the aggregated mode and unit tests. Copies tensor to tensor."""

from __future__ import annotations

import asyncio
import time

from kvtransfer.errors import PeerGone
from kvtransfer.transport import (BlockSource, LayerSink, TransferStats, Transport,
                                  TransportConfig)
from kvtransfer.wire import ReadRequest


class LocalHub:
    """The agents of one process that pull from each other, by address. Share one hub between
    the agents that must see each other (an explicit object, not a module global)."""

    def __init__(self) -> None:
        self._sources: dict[str, BlockSource] = {}
        self._next_id = 0

    def register(self, source: BlockSource) -> str:
        self._next_id += 1
        address = f"local://{self._next_id}"
        self._sources[address] = source
        return address

    def unregister(self, address: str) -> None:
        self._sources.pop(address, None)

    def lookup(self, address: str) -> BlockSource:
        source = self._sources.get(address)
        if source is None:
            raise PeerGone(f"no agent serves {address!r} in this process (closed, or another "
                           "hub)")
        return source


class LocalTransport(Transport):
    name = "local"

    def __init__(self, hub: LocalHub) -> None:
        self._hub = hub
        self._address: str | None = None

    @classmethod
    def from_config(cls, config: TransportConfig, hub: object | None = None) -> LocalTransport:
        if not isinstance(hub, LocalHub):
            raise ValueError("the local transport needs the LocalHub shared by both agents; got "
                             f"{hub!r}")
        return cls(hub)

    async def start(self, source: BlockSource) -> str:
        self._address = self._hub.register(source)
        return self._address

    async def fetch(self, address: str, request: ReadRequest, sink: LayerSink) -> TransferStats:
        source = self._hub.lookup(address)
        start = time.perf_counter()
        read = source.open_read(request)
        messages = 0
        try:
            for layer in range(sink.num_layers):
                for src, dst in zip(read.layer_views(layer), sink.layer_views(layer)):
                    dst.copy_(src)
                    messages += 1
                sink.landed(layer)
                await asyncio.sleep(0)  # let other pulls and the lease timers run
        finally:
            source.close_read(read)
        return TransferStats(sink.bytes_per_layer * sink.num_layers, messages,
                             time.perf_counter() - start)

    async def close(self) -> None:
        if self._address is not None:
            self._hub.unregister(self._address)
            self._address = None
