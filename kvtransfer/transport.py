"""The interface every transport implements (`registry` picks one by name).

Contract of a `Transport` (one per agent; the agent owns it):

- `start(source)` begins serving `source` and returns the address pullers pass to `fetch`. For
  each incoming pull it calls `source.open_read(request)`, which validates the lease and the
  layouts and raises a `TransferError` before any byte is sent (the transport sends that error's
  kind back), and `source.close_read(read)` exactly once when the pull ends, however it ends
  (completed, rejected after open, peer gone).
- `fetch(address, request, sink)` writes only into `sink`'s destination views, calls
  `sink.landed(layer)` once per layer, in layer order, when that layer's bytes are in place, and
  returns after the last layer with its `TransferStats`. It raises a `TransferError` subclass;
  a source-side rejection arrives as the same class. Cancelling it (the agent's timeout) closes
  the connection and returns only when nothing can write into the destination any more; the
  destination blocks then hold garbage and the caller frees them.
- `close()` stops serving and drops every connection; reads in progress end (`close_read`).

Transports do not know about leases, layouts or block ids: `open_read` and the sink's
`ReadPlan` give them tensor views, sent and received in plan order.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol
from collections.abc import Callable, Sequence

import torch

from kvtransfer.plan import ReadPlan
from kvtransfer.wire import ReadRequest


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    num_messages: int  # data messages (frames, sends) for the whole pull, all layers
    seconds: float


@dataclass
class SourceRead:
    """One accepted pull on the source: the views to send, layer by layer."""

    lease_ids: tuple[str, ...]  # the leases it reads, in wire order
    plan: ReadPlan
    caches: Sequence[torch.Tensor]
    bytes_per_layer: int

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    def layer_views(self, layer: int) -> list[torch.Tensor]:
        return self.plan.src_views(self.caches[layer])


class BlockSource(Protocol):
    def open_read(self, request: ReadRequest) -> SourceRead: ...

    def close_read(self, read: SourceRead) -> None: ...


@dataclass
class LayerSink:
    """Where one pull lands on the destination, and who hears that a layer has landed."""

    plan: ReadPlan
    caches: Sequence[torch.Tensor]
    bytes_per_layer: int
    on_landed: Callable[[int], None]
    started: float = field(default_factory=time.perf_counter)

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    def layer_views(self, layer: int) -> list[torch.Tensor]:
        return self.plan.dst_views(self.caches[layer])

    def landed(self, layer: int) -> None:
        self.on_landed(layer)


class Transport(ABC):
    name: str

    @classmethod
    @abstractmethod
    def from_config(cls, config: TransportConfig, hub: object | None = None) -> Transport:
        """The transport `config` describes; `hub` is the `LocalHub` for kind "local"."""

    @abstractmethod
    async def start(self, source: BlockSource) -> str: ...

    @abstractmethod
    async def fetch(self, address: str, request: ReadRequest, sink: LayerSink) -> TransferStats: ...

    @abstractmethod
    async def close(self) -> None: ...


def as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"tensor on {t.device} with strides {t.stride()}; expected contiguous "
                         "CPU memory")
    # ndarray has the buffer protocol; numpy's stubs declare it only for Python 3.12+
    return memoryview(
        t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # stubs: 3.12+ only


@dataclass(frozen=True)
class TransportConfig:
    """Which transport an agent uses. `host` is the interface to bind and publish."""

    kind: str = "tcp"  # one of `registry.TRANSPORTS`
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    collective_backend: str = "auto"  # nccl transport: "nccl", "gloo", or by the caches' device
