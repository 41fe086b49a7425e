"""The boundary between the router and a worker: one request record in, token events out.

Torch-free. The router holds one `WorkerClient` per worker and never touches an engine directly;
an in-process client (`cluster.inprocess_client.InProcessWorkerClient`) and a remote one (gRPC, Ray) are
interchangeable behind it. Prompts cross this boundary as token ids: the router tokenizes, so it
can hash the prompt's blocks for routing.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from workers.protocol import (
    EngineStats,
    KVEvent,
    KVPullFailed,
    KVSnapshot,
    PrefillResult,
    SamplingParams,
    TokenEvent,
    WorkerInfo,
    WorkerRequest,
    WorkerRole,
)

__all__ = ["HandoffWorkerClient", "KVPullFailed", "PrefillResult", "WorkerClient", "WorkerInfo",
           "WorkerRequest", "WorkerRole", "EngineStats"]


class WorkerClient(abc.ABC):
    """How the router talks to one worker. Methods may raise `router.errors.WorkerUnavailableError`
    when the worker cannot be reached; `generate` raises `workers.protocol.InvalidRequestError`
    for a request the worker refuses, before the first event."""

    @property
    @abc.abstractmethod
    def worker_id(self) -> str: ...

    @abc.abstractmethod
    async def info(self) -> WorkerInfo: ...

    @abc.abstractmethod
    def generate(self, req: WorkerRequest) -> AsyncIterator[TokenEvent]:
        """The request's token events until all its samples finish. Closing or cancelling the
        iterator before the end aborts the request on the worker and frees its blocks."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Cancel a request; unknown ids are ignored."""

    @abc.abstractmethod
    async def stats(self) -> EngineStats: ...

    @abc.abstractmethod
    async def kv_events(self) -> list[KVEvent]:
        """Drain the KV events emitted since the last call (each event is returned once)."""

    @abc.abstractmethod
    async def kv_snapshot(self) -> KVSnapshot: ...

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the worker can take requests."""

    async def close(self) -> None:
        """Release what the client holds (connections, an in-process engine)."""


class HandoffWorkerClient(WorkerClient):
    """A worker that can take either half of a disaggregated request (the KV handoff). Which
    half it is asked for follows its `WorkerInfo.role`: prefill for PREFILL (or BOTH), decode
    for DECODE (or BOTH); the worker refuses the other with `ValueError`."""

    @abc.abstractmethod
    async def prefill(self, req: WorkerRequest, kv_readers: int = 1) -> PrefillResult:
        """Run the prompt to its first token and offer its KV under a lease per TP rank, each
        waiting for `kv_readers` pulls (decode TP size / prefill TP size when larger). Raises
        `InvalidRequestError` for a bad request; cancelling leaves nothing held."""

    @abc.abstractmethod
    def decode(self, req: WorkerRequest, first_token_id: int,
               handoff_json: str | None) -> AsyncIterator[TokenEvent]:
        """The events after `first_token_id`. With `handoff_json` (from `prefill`) the prompt's
        KV is pulled, and `KVPullFailed` is raised before any event when that fails; with None
        the worker computes the prompt's KV itself. Closing early aborts, as `generate`."""

    @abc.abstractmethod
    def resume(self, req: WorkerRequest,
               sent_token_ids: Sequence[int]) -> AsyncIterator[TokenEvent]:
        """The events after `sent_token_ids`, the request's first output tokens, which other
        workers sampled and sent (one failed mid-stream); the worker computes the KV of the
        prompt and those tokens itself. For DECODE (or BOTH) workers, n = 1. Greedy output
        equals an uninterrupted run; seeded sampling may differ. Closing early aborts."""
