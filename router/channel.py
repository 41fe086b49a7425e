"""`ChannelClient`: a `WorkerClient` over one long-lived channel to a worker. Torch-free.

Across the process boundary there is one message per engine step, not one call per token:
- requests and aborts go out batched: the commands issued in one turn of the event loop travel
  in one `Submit` call;
- one reader task long-polls `WorkerChannel.next_outputs`, which returns a `WorkerOutputs` (every
  new token of this router's requests on that worker, their failures, the KV events and load),
  and demultiplexes it into per-request `RequestStream`s; KV events and load go to the
  `WorkerListener` (the router's worker set), so routing reads no stats per request;
- only `prefill` is one call per request (it returns the first token and the KV handoff);
  every call (`WorkerChannel.call`, a record of `workers.contract.calls`) is answered within
  the client's deadline, or the worker counts as unavailable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from router.config import DEFAULT_DEADLINES, Deadlines
from router.errors import WorkerUnavailableError
from router.request_stream import RequestStream
from router.worker_client import WorkerChannel, WorkerClient, WorkerListener
from workers.contract.calls import Call, Submit
from workers.contract.messages import Abort, Command, FailureKind, StreamCommand, WorkerOutputs

logger = logging.getLogger(__name__)
R = TypeVar("R")

POLL_TIMEOUT_S = 0.5  # a worker answers a poll at least this often (a heartbeat with its load)
RETRY_PAUSE_S = 0.5  # after a failed poll, before the next


class ChannelClient(WorkerClient):
    """One router's client of one worker. `subscriber` names the router to the worker (every
    router replica has its own output channel)."""

    def __init__(self, channel: WorkerChannel, subscriber: str,
                 deadlines: Deadlines = DEFAULT_DEADLINES) -> None:
        self.channel = channel
        self.subscriber = subscriber
        self.deadlines = deadlines
        self._streams: dict[str, RequestStream] = {}
        self._outgoing: list[Command] = []
        self._listener: WorkerListener | None = None
        self._reader: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def worker_id(self) -> str:
        return self.channel.worker_id

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerUnavailableError(self.worker_id, "the client is closed")

    def attach(self, listener: WorkerListener) -> None:
        self._listener = listener
        self._ensure_reader()

    # ---- the primitives (`WorkerClient`) ------------------------------------------------------

    def open(self, cmd: StreamCommand) -> RequestStream:
        """The command's stream; a closed client's fails at its first read."""
        rid = cmd.req.request_id
        if self._closed:
            stream = RequestStream(rid, cmd.num_samples, self._stream_finished)
            stream.put(WorkerUnavailableError(self.worker_id, "the client is closed"))
            return stream
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already streaming from "
                             f"{self.worker_id!r}")
        stream = RequestStream(rid, cmd.num_samples, self._stream_finished)
        self._streams[rid] = stream
        self._ensure_reader()
        self._queue(cmd)
        return stream

    def send(self, cmd: Abort) -> None:
        stream = self._streams.get(cmd.request_id)
        if stream is not None:
            stream._finish(abort=True)  # its events are not awaited any more; sends the abort
        else:
            self._queue(cmd)

    async def call(self, call: Call[R]) -> R:
        """The worker's answer within `deadlines.prefill_s`; past it the call is undone there
        and `WorkerUnavailableError` raised."""
        self._check_open()
        try:
            async with asyncio.timeout(self.deadlines.prefill_s):  # no task per call
                return await self.channel.call(call)
        except asyncio.CancelledError:
            self._undo(call)
            raise
        except TimeoutError:
            self._undo(call)
            raise WorkerUnavailableError(self.worker_id, f"{type(call).__name__} not answered "
                                         f"in {self.deadlines.prefill_s} s") from None

    def _undo(self, call: Call[Any]) -> None:
        request_id = call.undone_by_abort()
        if request_id is not None:
            self._queue(Abort(request_id))

    def _stream_finished(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort:
            self._queue(Abort(request_id))

    # ---- the channel ---------------------------------------------------------------------------

    def _queue(self, cmd: Command) -> None:
        """Queue a command; the commands of one event-loop turn go out in one call."""
        if self._closed:
            return
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(cmd)

    def _flush(self) -> None:
        commands, self._outgoing = self._outgoing, []
        if commands:
            self._spawn(self._submit(commands))

    async def _submit(self, commands: list[Command]) -> None:
        try:
            await self.call(Submit(self.subscriber, tuple(commands)))
        except Exception as exc:  # noqa: BLE001 -- the requests sent fail with it
            err = exc if isinstance(exc, WorkerUnavailableError) else WorkerUnavailableError(
                self.worker_id, f"submit failed: {exc!r}")
            for cmd in commands:
                if not isinstance(cmd, Abort):
                    stream = self._streams.get(cmd.req.request_id)
                    if stream is not None:
                        stream.put(err)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ensure_reader(self) -> None:
        if not self._closed and (self._reader is None or self._reader.done()):
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    async def _read_forever(self) -> None:
        while not self._closed:
            try:
                # a deadline on this task, not `wait_for`'s task per message
                async with asyncio.timeout(POLL_TIMEOUT_S + self.deadlines.stall_s):
                    out = await self.channel.next_outputs(self.subscriber, POLL_TIMEOUT_S,
                                                          self.channel.output_interval_s)
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                self._fail_streams(WorkerUnavailableError(
                    self.worker_id, f"its output channel was silent for "
                    f"{POLL_TIMEOUT_S + self.deadlines.stall_s} s"))
                continue
            except Exception as exc:  # noqa: BLE001 -- the worker is unreachable
                self._fail_streams(exc)
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            self._deliver(out)
            if not out.stats.healthy and self._streams:
                self._fail_streams(WorkerUnavailableError(
                    self.worker_id, "it reports itself unhealthy (a stalled step or a dead rank)"))

    def _deliver(self, out: WorkerOutputs) -> None:
        streams = self._streams
        for event in out.events:
            stream = streams.get(event.request_id)
            if stream is not None:  # else: closed meanwhile
                stream.put(event)
        for failure in out.failures:
            stream = streams.get(failure.request_id)
            if stream is not None:  # an engine going away is the worker being unavailable
                stream.put(WorkerUnavailableError(self.worker_id, failure.message)
                           if failure.kind is FailureKind.ENGINE_SHUT_DOWN
                           else failure.to_exception())
        if self._listener is not None:
            self._listener.on_outputs(self.worker_id, out.kv_events, out.stats)

    def _fail_streams(self, exc: BaseException) -> None:
        err = exc if isinstance(exc, WorkerUnavailableError) else WorkerUnavailableError(
            self.worker_id, f"its output channel failed: {exc!r}")
        for stream in list(self._streams.values()):
            stream.put(err)
        if self._listener is not None:
            self._listener.on_unreachable(self.worker_id, err)

    async def close(self) -> None:
        """Stop reading; streams still open fail as the worker being gone."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._reader, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gone = WorkerUnavailableError(self.worker_id, "the client was closed")
        for stream in list(self._streams.values()):
            stream.put(gone)
        if self._listener is not None:
            self._listener.on_unreachable(self.worker_id, gone)
        await self.channel.close()
