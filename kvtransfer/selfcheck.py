"""The start-up self-check: a transport moves a test pattern to itself before a worker uses it.

Two throwaway agents on the configured transport (same process, same interface as the real
ones) hand a few blocks of a known pattern from one to the other through the full path: offer,
connect, read, land. A transport that cannot connect, moves nothing, or lands wrong bytes is an
error at start (`SelfCheckFailed`), never a silent fallback to something slower.
"""

from __future__ import annotations

import torch

from kvtransfer.agent import TransferAgent
from kvtransfer.handoff import KVLayout
from kvtransfer.errors import TransferError
from kvtransfer.local import LocalHub
from kvtransfer.transport import TransportConfig

# small, but several blocks and layers so plans coalesce and layers are sent in turn
_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
_NUM_BLOCKS = 6
# transports that pair two processes (a collective group per pair): no loopback within one
NOT_SELF_CHECKED = ("nccl",)


class SelfCheckFailed(TransferError):
    """The configured transport failed its start-up self-check."""


async def self_check(config: TransportConfig, timeout_s: float = 30.0) -> None:
    """Move a pattern from one throwaway agent to another over `config`'s transport and
    verify it; raises `SelfCheckFailed` naming the transport and what went wrong."""
    if config.kind in NOT_SELF_CHECKED:
        return
    shape = (2, _NUM_BLOCKS, _LAYOUT.block_size, _LAYOUT.num_kv_heads, _LAYOUT.head_dim)
    pattern = [torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + i
               for i in range(_LAYOUT.num_layers)]
    landed = [torch.zeros(shape) for _ in range(_LAYOUT.num_layers)]
    hub = LocalHub()
    source = TransferAgent(_LAYOUT, pattern, config, hub=hub)
    sink = TransferAgent(_LAYOUT, landed, config, hub=hub)
    src_blocks, dst_blocks = [1, 2, 4], [0, 3, 5]
    try:
        await source.start()
        await sink.start()
        handoff = source.offer("self-check", src_blocks, lease_s=timeout_s)
        await sink.pull(handoff, dst_blocks, timeout=timeout_s)
    except (TransferError, OSError) as exc:
        raise SelfCheckFailed(f"the {config.kind!r} transport failed its self-check: "
                              f"{type(exc).__name__}: {exc}") from exc
    finally:
        await sink.close()
        await source.close()
    for layer in range(_LAYOUT.num_layers):
        want = pattern[layer][:, src_blocks]
        if not torch.equal(landed[layer][:, dst_blocks], want):
            raise SelfCheckFailed(f"the {config.kind!r} transport landed wrong bytes in its "
                                  f"self-check (layer {layer})")
