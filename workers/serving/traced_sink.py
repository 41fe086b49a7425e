"""The decode worker's spans of one request after its KV landed: `worker.first_step` (from the
landing to its first event: the first decode step) and `worker.stream` (to its last event, or
its failure, with the tokens it streamed), both the children of the request's `traceparent`.
Made only while tracing is on (`traced`); off, the sink is used as it is."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from workers.contract.protocol import TokenEvent, WorkerRequest
from workers.contract.tracing import tracing

if TYPE_CHECKING:
    from workers.engine.outputs import Sink


def traced(sink: Sink, req: WorkerRequest, worker_id: str) -> Sink:
    """`sink`, recording `req`'s decode spans as its events pass (itself when tracing is
    off)."""
    return _TracedSink(sink, req, worker_id) if tracing().on else sink


class _TracedSink:
    """A `Sink` that passes everything on, timing one request's events."""

    def __init__(self, sink: Sink, req: WorkerRequest, worker_id: str) -> None:
        self._sink, self._req = sink, req
        self._attributes = {"worker": worker_id}
        self._landed_ns = time.time_ns()
        self._first = True
        self._num_tokens = 0
        self._left = req.params.n  # samples not finished

    def put(self, event: TokenEvent) -> None:
        if event.request_id == self._req.request_id:
            now = time.time_ns()
            if self._first:
                self._first = False
                tracing().record("worker.first_step", self._req.traceparent, self._landed_ns,
                                 now, self._attributes)
            self._num_tokens += len(event.token_ids)
            if event.finish_reason is not None:
                self._left -= 1
                if self._left == 0:
                    self._end(now, "finished")
        self._sink.put(event)

    def fail(self, request_id: str, exc: BaseException) -> None:
        if request_id == self._req.request_id and self._left > 0:
            self._left = 0
            self._end(time.time_ns(), type(exc).__name__)
        self._sink.fail(request_id, exc)

    def flush(self) -> None:
        self._sink.flush()

    def _end(self, now: int, outcome: str) -> None:
        tracing().record("worker.stream", self._req.traceparent, self._landed_ns, now, {
            **self._attributes, "tokens": self._num_tokens, "outcome": outcome})
