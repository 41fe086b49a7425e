"""Attention backends by name. Each entry is an import path, imported only when that backend is
asked for, so registering one costs nothing: the torch backend neither needs nor pays for triton,
and no backend module imports another's."""

from __future__ import annotations

import importlib
import importlib.util
from typing import NamedTuple

from workers.attention.backend import AttentionBackend


class BackendEntry(NamedTuple):
    path: str  # "module:Class" of the `AttentionBackend`
    needs: str | None = None  # the optional package it imports, checked before importing it


BACKENDS: dict[str, BackendEntry] = {
    "torch": BackendEntry("workers.attention.torch_backend:TorchAttentionBackend"),
    "cpu": BackendEntry("workers.attention.cpu_backend:CpuAttentionBackend"),
    "triton": BackendEntry("workers.attention.triton_backend:TritonAttentionBackend", "triton"),
}


def get_backend(name: str) -> AttentionBackend:
    """A new instance of the backend `name`; raises `ValueError` for an unknown name or a
    missing package (and whatever the backend's constructor raises, e.g. a kernel that does
    not build)."""
    entry = BACKENDS.get(name)
    if entry is None:
        raise ValueError(f"unknown attention backend {name!r}; expected one of "
                         f"{sorted(BACKENDS)}")
    if entry.needs is not None and importlib.util.find_spec(entry.needs) is None:
        raise ValueError(f"attention backend {name!r} needs the {entry.needs!r} package, which "
                         "is not installed")
    module, _, cls_name = entry.path.partition(":")
    cls: type[AttentionBackend] = getattr(importlib.import_module(module), cls_name)
    return cls()
