"""Moving paged KV blocks between workers (local, TCP, UCX, NCCL/gloo). Imports no other Cleave
package.

One `TransferAgent` per worker rank registers the rank's per-layer cache tensors
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, serves them under leases (`offer`), and
pulls other ranks' handoffs into local blocks (`pull`), resharding heads between tensor-parallel
sizes. See `agent` for the lifecycle and `transport` for the contract every transport keeps.
"""

from __future__ import annotations

from kvtransfer.agent import PullResult, TransferAgent
from kvtransfer.descriptors import Handoff, KVLayout, MemoryOrder, check_transferable
from kvtransfer.errors import (InvalidDescriptor, LayoutMismatch, LeaseExpired, PeerGone,
                               TransferError, TransferTimeout, TransportUnavailable)
from kvtransfer.local import LocalHub
from kvtransfer.selfcheck import SelfCheckFailed, self_check
from kvtransfer.transport import TRANSPORTS, Transport, TransportConfig, make_transport

__all__ = [
    "Handoff", "InvalidDescriptor", "KVLayout", "LayoutMismatch", "LeaseExpired", "LocalHub",
    "MemoryOrder", "PeerGone", "PullResult", "SelfCheckFailed", "TRANSPORTS", "TransferAgent",
    "TransferError", "TransferTimeout", "Transport", "TransportConfig", "TransportUnavailable",
    "check_transferable", "make_transport", "self_check",
]
