"""The router's channel to a `workers.serving.worker.Worker` in its own process and event loop.

The same `router.channel.ChannelClient` as over Ray, with the calls made directly: the worker's
output channel and batched commands are used as they are across processes, so the in-process
server measures the same path minus Ray. A worker process and an engine actor serve their
socket through this channel too (`cluster.socket_calls.serve_channel`). Importing this module
does not import torch (the worker is built by the caller).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from router.channel import ChannelClient
from router.config import DEFAULT_DEADLINES, Deadlines
from router.errors import WorkerUnavailableError
from router.worker_client import WorkerChannel
from workers.contract.calls import Call
from workers.contract.messages import WorkerOutputs
from workers.contract.protocol import EngineShutDown
from workers.serving.dispatch import dispatch

if TYPE_CHECKING:
    from workers.serving.worker import Worker

SUBSCRIBER = "in-process"
R = TypeVar("R")


class InProcessChannel(WorkerChannel):
    """Owns its worker: `close()` shuts it down. A message is a return value here: one per
    step (`output_interval_s` 0). An engine going away (`EngineShutDown`) is raised as the
    worker being unavailable."""

    output_interval_s = 0.0

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.worker_id = worker.worker_id
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerUnavailableError(self.worker_id, "the worker was shut down")

    async def call(self, call: Call[R]) -> R:
        self._check_open()
        try:
            return await dispatch(self.worker, call)
        except EngineShutDown as exc:
            raise WorkerUnavailableError(self.worker_id, str(exc)) from None

    async def next_outputs(self, subscriber: str, timeout_s: float,
                           min_interval_s: float = 0.0) -> WorkerOutputs:
        self._check_open()
        try:
            return await self.worker.next_outputs(subscriber, timeout_s, min_interval_s)
        except EngineShutDown as exc:
            raise WorkerUnavailableError(self.worker_id, str(exc)) from None

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.worker.shutdown()


def in_process_client(worker: Worker,
                      deadlines: Deadlines = DEFAULT_DEADLINES) -> ChannelClient:
    """The router's client of a worker in this process (the client owns the worker)."""
    return ChannelClient(InProcessChannel(worker), SUBSCRIBER, deadlines)
