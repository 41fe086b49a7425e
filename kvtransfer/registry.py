"""Transports by name. Each entry is an import path, imported only when that transport is built,
so registering one costs nothing and no transport module imports another (`ucx` needs `ucxx`,
`nccl` needs torch.distributed)."""

from __future__ import annotations

import importlib

from kvtransfer.transport import Transport, TransportConfig

# transport name (`TransportConfig.kind`) -> "module:Class" of its `Transport`
TRANSPORTS: dict[str, str] = {
    "local": "kvtransfer.local:LocalTransport",
    "tcp": "kvtransfer.tcp:TcpTransport",
    "ucx": "kvtransfer.ucx:UcxTransport",
    "nccl": "kvtransfer.collective:CollectiveTransport",
}


def make_transport(config: TransportConfig, *, hub: object | None = None) -> Transport:
    """Build the transport `config.kind` names; `hub` is the `LocalHub` for kind "local".
    Raises `ValueError` for an unknown kind, `TransportUnavailable` when it cannot run here."""
    path = TRANSPORTS.get(config.kind)
    if path is None:
        raise ValueError(f"transport {config.kind!r}; expected one of {sorted(TRANSPORTS)}")
    module, _, name = path.partition(":")
    cls: type[Transport] = getattr(importlib.import_module(module), name)
    return cls.from_config(config, hub)
