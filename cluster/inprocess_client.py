"""The router's channel to a `workers.serving.worker.Worker` in its own process and event loop.

The same `router.channel.ChannelClient` as over Ray, with the calls made directly: the worker's
output channel and batched commands are used as they are across processes, so the in-process
server measures the same path minus Ray. Importing this module does not import torch (the
worker is built by the caller).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, TypeVar

from router.channel import ChannelClient
from router.config import Deadlines
from router.errors import WorkerUnavailableError
from router.worker_client import WorkerChannel
from workers.contract.messages import Command, Paused, PrefillResult, PrefixFetch, WorkerOutputs
from workers.contract.protocol import (
    EngineShutDown,
    EngineStats,
    WorkerInfo,
    WorkerRequest,
)
from workers.contract.prefix_cache import HotPrefix, KVSnapshot

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff
    from workers.serving.worker import Worker

SUBSCRIBER = "in-process"
T = TypeVar("T")


class InProcessChannel(WorkerChannel):
    """Owns its worker: `close()` shuts it down. A message is a return value here: one per
    step (`output_interval_s` 0)."""

    output_interval_s = 0.0

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.worker_id = worker.worker_id
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerUnavailableError(self.worker_id, "the worker was shut down")

    async def info(self) -> WorkerInfo:
        self._check_open()
        return self.worker.info

    async def submit(self, subscriber: str, commands: list[Command]) -> None:
        self._check_open()
        self.worker.submit(subscriber, commands)

    async def next_outputs(self, subscriber: str, timeout_s: float,
                           min_interval_s: float = 0.0) -> WorkerOutputs:
        self._check_open()
        return await self.worker.next_outputs(subscriber, timeout_s, min_interval_s)

    async def prefill(self, req: WorkerRequest, decode_tp_size: int,
                      prefix: PrefixFetch | None = None) -> PrefillResult:
        self._check_open()
        try:
            return await self.worker.prefill(req, decode_tp_size, prefix)
        except EngineShutDown as exc:
            raise WorkerUnavailableError(self.worker_id, str(exc)) from None

    async def export_prefix(self, request_id: str, block_hashes: tuple[int, ...],
                            reader_tp_size: int) -> KVHandoff | None:
        self._check_open()
        try:
            return await self.worker.export_prefix(request_id, block_hashes, reader_tp_size)
        except EngineShutDown as exc:
            raise WorkerUnavailableError(self.worker_id, str(exc)) from None

    async def hot_prefixes(self, max_blocks: int) -> tuple[HotPrefix, ...]:
        return await self._call(self.worker.hot_prefixes(max_blocks))

    async def land_prefix(self, request_id: str, fetch: PrefixFetch,
                          token_ids: tuple[int, ...]) -> int:
        return await self._call(self.worker.land_prefix(request_id, fetch, token_ids))

    async def export_running(self, request_id: str,
                             reader_tp_size: int) -> dict[int, KVHandoff]:
        return await self._call(self.worker.export_running(request_id, reader_tp_size))

    async def prepare_migration(self, request_id: str,
                                exported: dict[int, KVHandoff]) -> dict[int, int]:
        return await self._call(self.worker.prepare_migration(request_id, exported))

    async def pause(self, request_id: str, reader_tp_size: int) -> Paused:
        return await self._call(self.worker.pause(request_id, reader_tp_size))

    async def cancel_migration(self, request_id: str) -> None:
        await self._call(self.worker.cancel_migration(request_id))

    async def _call(self, call: Awaitable[T]) -> T:
        self._check_open()
        try:
            return await call
        except EngineShutDown as exc:
            raise WorkerUnavailableError(self.worker_id, str(exc)) from None

    async def stats(self) -> EngineStats:
        self._check_open()
        return self.worker.stats()

    async def kv_snapshot(self) -> KVSnapshot:
        self._check_open()
        return await self.worker.kv_snapshot()

    async def health(self) -> bool:
        return not self._closed and self.worker.async_engine.is_healthy

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.worker.shutdown()


def in_process_client(worker: Worker, deadlines: Deadlines = Deadlines()) -> ChannelClient:
    """The router's client of a worker in this process (the client owns the worker)."""
    return ChannelClient(InProcessChannel(worker), SUBSCRIBER, deadlines)
