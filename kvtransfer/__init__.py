"""Moving paged KV blocks between workers (local, TCP, UCX, NCCL/gloo). Imports no other Cleave
package.

One `TransferAgent` per worker rank registers the rank's per-layer cache tensors
`[2, num_blocks, block_size, num_kv_heads, head_dim]`, serves them under leases (`offer`), and
pulls other ranks' handoffs into local blocks (`pull`), resharding heads between tensor-parallel
sizes. See `agent` for the lifecycle and `transport` for the contract every transport keeps.

The package loads lazily: `from kvtransfer import TransferAgent` imports `kvtransfer.agent` (and
torch) on first use, while `import kvtransfer.handoff` loads only the torch-free records.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the submodule that defines it (loaded on first access, PEP 562)
_EXPORTS: dict[str, str] = {
    "PullResult": "agent", "TransferAgent": "agent",
    "DTYPE_SIZES": "handoff", "HANDOFF_VERSION": "handoff", "Handoff": "handoff",
    "KVHandoff": "handoff", "KVLayout": "handoff", "MemoryOrder": "handoff",
    "check_transferable": "handoff",
    "InvalidDescriptor": "errors", "LayoutMismatch": "errors", "LeaseExpired": "errors",
    "PeerGone": "errors", "TransferError": "errors", "TransferTimeout": "errors",
    "TransportUnavailable": "errors",
    "LocalHub": "local",
    "AgentHost": "agent_host", "RemoteAgent": "remote", "AgentHostAddress": "remote_messages",
    "SelfCheckFailed": "selfcheck", "self_check": "selfcheck",
    "TRANSPORTS": "registry", "make_transport": "registry",
    "Transport": "transport", "TransportConfig": "transport",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 -- the lazily imported names above


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvtransfer.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
