"""`WorkerClient` for a `workers.worker.Worker` in the router's own process and event loop.

Importing this module does not import torch (the worker is built by the caller).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

from router.errors import WorkerUnavailableError
from router.worker_client import (
    HandoffWorkerClient,
    WorkerInfo,
    WorkerRequest,
    WorkerRole,
    EngineStats,
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
                          w.vocab_size, w.num_blocks, w.tp_size)

    async def _relay(self, open_stream: Callable[[], AsyncIterator[TokenEvent]]
                     ) -> AsyncIterator[TokenEvent]:
        """The events of `open_stream()`, opened at the first `__anext__` once this client is
        checked open; a failure after the client was closed (the worker shut down under the
        request) is raised as `WorkerUnavailableError`. Closing it closes the stream (which
        aborts the request when it has not finished)."""
        self._check_open()
        stream = open_stream()
        try:
            async for event in stream:
                yield event
        except Exception as exc:
            if self._closed:
                raise WorkerUnavailableError(self.worker_id, f"closed mid-stream: {exc}") from exc
            raise
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def generate(self, req: WorkerRequest) -> AsyncIterator[TokenEvent]:
        return self._relay(lambda: self.worker.generate(
            req.request_id, list(req.prompt_token_ids), req.params, req.cache_salt))

    async def prefill(self, req: WorkerRequest, kv_readers: int = 1) -> PrefillResult:
        self._check_open()
        return await self.worker.prefill(req.request_id, list(req.prompt_token_ids), req.params,
                                         req.cache_salt, kv_readers)

    def decode(self, req: WorkerRequest, first_token_id: int,
               handoff_json: str | None) -> AsyncIterator[TokenEvent]:
        return self._relay(lambda: self.worker.decode(
            req.request_id, list(req.prompt_token_ids), first_token_id, req.params,
            handoff_json))

    def resume(self, req: WorkerRequest,
               sent_token_ids: Sequence[int]) -> AsyncIterator[TokenEvent]:
        return self._relay(lambda: self.worker.resume(
            req.request_id, list(req.prompt_token_ids), list(sent_token_ids), req.params))

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    async def stats(self) -> EngineStats:
        self._check_open()
        return self.worker.stats()

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
