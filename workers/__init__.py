"""The Cleave inference engine.

Importing this package does not import torch: the request types (`SamplingParams`, token and KV
events) are torch-free so the router can use them; `LLM`, `Engine` and `AsyncEngine` load on
first use.
"""

from __future__ import annotations

from typing import Any

from workers.contract.protocol import (
    CompletionOutput,
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    TokenEvent,
)

_LAZY = {
    "LLM": "workers.engine.llm",
    "Engine": "workers.engine.core",
    "EngineConfig": "workers.engine.config",
    "AsyncEngine": "workers.engine.async_engine",
}

__all__ = ["CompletionOutput", "FinishReason", "InvalidRequestError",  # noqa: PLE0604 -- with
           "RequestOutput", "SamplingParams", "TokenEvent", *_LAZY]  # the lazy names


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
