"""`WorkerClient` for a `workers.worker.Worker` in the router's own process and event loop.

Importing this module does not import torch (the worker is built by the caller).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from router.errors import WorkerUnavailableError
from router.worker_client import (
    HandoffWorkerClient,
    WorkerInfo,
    WorkerRequest,
    WorkerRole,
    WorkerStats,
)
from workers.protocol import KVEvent, KVSnapshot, PrefillResult, TokenEvent

if TYPE_CHECKING:
    from workers.worker import Worker


class InProcessWorkerClient(HandoffWorkerClient):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._closed = False

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerUnavailableError(self.worker_id, "the client is closed")

    async def info(self) -> WorkerInfo:
        self._check_open()
        w = self.worker
        return WorkerInfo(w.worker_id, WorkerRole(w.role), w.block_size, w.max_model_len,
                          w.vocab_size, w.num_blocks)

    async def generate(self, req: WorkerRequest) -> AsyncIterator[TokenEvent]:
        self._check_open()
        stream = self.worker.generate(req.request_id, list(req.prompt_token_ids), req.params,
                                       req.cache_salt)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()  # aborts the request when it has not finished

    async def prefill(self, req: WorkerRequest) -> PrefillResult:
        self._check_open()
        return await self.worker.prefill(req.request_id, list(req.prompt_token_ids), req.params,
                                         req.cache_salt)

    async def decode(self, req: WorkerRequest, first_token_id: int,
                     handoff_json: str | None) -> AsyncIterator[TokenEvent]:
        self._check_open()
        stream = self.worker.decode(req.request_id, list(req.prompt_token_ids), first_token_id,
                                    req.params, handoff_json)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> WorkerStats:
        self._check_open()
        s = self.worker.stats()
        return WorkerStats(s.num_waiting, s.num_running, s.kv_usage, s.num_free_blocks,
                           self.worker.num_blocks)

    async def kv_events(self) -> list[KVEvent]:
        self._check_open()
        return await self.worker.drain_kv_events()

    async def kv_snapshot(self) -> KVSnapshot:
        self._check_open()
        return await self.worker.kv_snapshot()

    async def health(self) -> bool:
        return not self._closed

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.worker.shutdown()
