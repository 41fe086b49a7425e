"""Where a worker's outputs go: the `Sink`s the async engine routes each request's events to
(`Routes`), and the output channel, one `WorkerOutputs` message per engine step per subscriber.

`RequestStream` is one request's events as an async iterator (in-process callers); an `Outbox`
gathers a subscriber's requests' events for the channel.

Each router (a subscriber) long-polls `OutputHub.next_outputs(subscriber)`: it returns as soon
as a step produced something for that router's requests (all of them in one message: new tokens,
failures), with the KV events it has not seen and the engine's stats, or after `timeout_s` with
no events (a heartbeat that keeps the router's view of the load fresh). A router that reads
slower than the engine steps gets several steps merged into one message, and so does one that
asks for at most one message per `min_interval_s` (its channel's `output_interval_s`).

KV events are kept in a bounded log that every subscriber reads with its own cursor, so each
router sees every event once; one that falls further behind than the log sees a sequence gap
and resyncs from the worker's snapshot. A subscriber that stops reading for `idle_s` is gone:
its requests are aborted and its outbox dropped.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Protocol

from workers.contract.messages import RequestFailed, WorkerOutputs
from workers.contract.protocol import EngineStats, TokenEvent
from workers.contract.prefix_cache import KVEvent


class Sink(Protocol):
    """Where one or more requests' events go. Called on the event loop's thread."""

    def put(self, event: TokenEvent) -> None:
        """One new event of a request routed here."""

    def fail(self, request_id: str, exc: BaseException) -> None:
        """The request ended with `exc`; nothing of it is held by the engine any more."""

    def flush(self) -> None:
        """The step is over: deliver what `put` and `fail` gathered."""


class RequestStream:
    """One request's events as an async iterator, for in-process callers. Ends after the last
    sample finished; raises what `fail` was given; `aclose()` before the end aborts."""

    def __init__(self, request_id: str, num_samples: int,
                 abort: Callable[[str], None]) -> None:
        """`abort`: cancels the request on the engine (when the reader leaves early)."""
        self._abort = abort
        self.request_id = request_id
        self._queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self._left = num_samples
        self._done = False

    def put(self, event: TokenEvent) -> None:
        self._queue.put_nowait(event)

    def fail(self, request_id: str, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    def flush(self) -> None:
        pass  # the queue wakes the reader already

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the caller is gone
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._left -= 1
            self._done = self._left == 0
        return item

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self.request_id)


class _Route:
    __slots__ = ("samples_left", "sink")

    def __init__(self, sink: Sink, samples_left: int) -> None:
        self.sink = sink
        self.samples_left = samples_left


class Routes:
    """Which sink each request's events go to, until its last sample's final event (the async
    engine's table). Event-loop thread."""

    def __init__(self) -> None:
        self._routes: dict[str, _Route] = {}

    def add(self, request_id: str, sink: Sink, num_samples: int) -> None:
        self._routes[request_id] = _Route(sink, num_samples)

    def drop(self, request_id: str) -> None:
        """Route nothing more of the request (unknown ids are ignored)."""
        self._routes.pop(request_id, None)

    def fail(self, request_id: str, exc: BaseException) -> None:
        """Route nothing more of the request; its sink fails with `exc` (after every event
        dispatched before). Unknown ids are ignored."""
        route = self._routes.pop(request_id, None)
        if route is not None:
            route.sink.fail(request_id, exc)
            route.sink.flush()

    def dispatch(self, events: list[TokenEvent]) -> None:
        """A step's events to their sinks (a request's route ends with its last sample's
        final event; events of requests no longer routed are dropped), each sink flushed
        once."""
        touched: dict[int, Sink] = {}
        routes = self._routes
        for event in events:
            route = routes.get(event.request_id)
            if route is None:  # aborted meanwhile
                continue
            route.sink.put(event)
            touched[id(route.sink)] = route.sink
            if event.finish_reason is not None:
                route.samples_left -= 1
                if route.samples_left == 0:
                    del routes[event.request_id]
        for sink in touched.values():
            sink.flush()

    def fail_all(self, error: Callable[[str], BaseException]) -> list[str]:
        """Fail every routed request with `error(request_id)`, flushing each sink once; returns
        their ids (no longer routed)."""
        routes, self._routes = self._routes, {}
        sinks: dict[int, Sink] = {}
        for rid, route in routes.items():
            route.sink.fail(rid, error(rid))
            sinks[id(route.sink)] = route.sink
        for sink in sinks.values():
            sink.flush()
        return list(routes)


KV_EVENT_LOG_SIZE = 65536  # events kept for routers that have not read them yet
SUBSCRIBER_IDLE_S = 30.0  # a subscriber silent this long is gone (it polls every second)


class KVEventLog:
    """KV events with absolute positions; each subscriber reads from its own cursor."""

    def __init__(self, size: int = KV_EVENT_LOG_SIZE) -> None:
        self._events: collections.deque[KVEvent] = collections.deque(maxlen=size)
        self._end = 0  # absolute position after the newest event
        self._cursors: dict[str, int] = {}

    def extend(self, events: list[KVEvent]) -> None:
        self._events.extend(events)
        self._end += len(events)

    def read(self, subscriber: str) -> tuple[KVEvent, ...]:
        """Events since this subscriber's last read (a new one starts at the oldest kept)."""
        start = self._end - len(self._events)
        cursor = max(self._cursors.get(subscriber, start), start)
        self._cursors[subscriber] = self._end
        # read from the right end: a message carries only the few newest events, and copying
        # the whole log (up to KV_EVENT_LOG_SIZE) on every message would cost the step loop
        events = self._events
        return tuple(events[i - self._end] for i in range(cursor, self._end))

    def forget(self, subscriber: str) -> None:
        self._cursors.pop(subscriber, None)


class Outbox:
    """One subscriber's outputs not yet read: the `Sink` its requests' events go to.
    `samples_left`: its requests the engine still runs (the worker adds them)."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.failures: list[RequestFailed] = []
        self.samples_left: dict[str, int] = {}  # its requests still running -> samples
        self.ready = asyncio.Event()
        self.last_read = time.monotonic()
        self.last_sent = 0.0  # when the last message left

    def put(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            left = self.samples_left.get(event.request_id, 1) - 1
            if left > 0:
                self.samples_left[event.request_id] = left
            else:
                self.samples_left.pop(event.request_id, None)

    def fail(self, request_id: str, exc: BaseException) -> None:
        self.failures.append(RequestFailed.from_exception(request_id, exc))
        self.samples_left.pop(request_id, None)

    def flush(self) -> None:
        self.ready.set()

    def take(self) -> tuple[tuple[TokenEvent, ...], tuple[RequestFailed, ...]]:
        events, failures = tuple(self.events), tuple(self.failures)
        self.events.clear()
        self.failures.clear()
        self.ready.clear()
        self.last_read = self.last_sent = time.monotonic()
        return events, failures


class OutputHub:
    """Every subscriber's outbox and the KV event log of one worker. Event-loop thread only."""

    def __init__(self, stats: Callable[[], EngineStats], abort: Callable[[str], None]) -> None:
        """`stats`: the engine's published stats; `abort`: cancels a request on the worker
        (for the requests of a subscriber that went away)."""
        self._stats = stats
        self._abort = abort
        self._outboxes: dict[str, Outbox] = {}
        self.kv_log = KVEventLog()

    def outbox(self, subscriber: str) -> Outbox:
        box = self._outboxes.get(subscriber)
        if box is None:
            box = self._outboxes[subscriber] = Outbox()
        return box

    def publish(self, kv_events: list[KVEvent]) -> None:
        """The engine published new stats (after a step, or after commands while idle) and
        these KV events: every subscriber gets them in a message now."""
        self.kv_log.extend(kv_events)
        for box in self._outboxes.values():
            box.ready.set()

    async def next_outputs(self, subscriber: str, timeout_s: float,
                           min_interval_s: float = 0.0) -> WorkerOutputs:
        """The subscriber's next message: at once when something is waiting, else when a step
        produces something or after `timeout_s` (then with no events); no sooner than
        `min_interval_s` after its last one (steps in between are merged)."""
        box = self.outbox(subscriber)
        box.last_read = time.monotonic()
        if not box.ready.is_set():
            try:
                async with asyncio.timeout(timeout_s):  # no task per wait, as `wait_for` makes
                    await box.ready.wait()
            except TimeoutError:
                pass
        # steps faster than `min_interval_s` (a small model) are merged, so a channel's
        # per-message cost does not eat the step loop's time
        wait = min_interval_s - (time.monotonic() - box.last_sent)
        if wait > 0:
            await asyncio.sleep(wait)
        self.reap_idle()
        events, failures = box.take()
        return WorkerOutputs(events, failures, self.kv_log.read(subscriber), self._stats())

    def reap_idle(self, idle_s: float = SUBSCRIBER_IDLE_S) -> None:
        """Drop the subscribers that stopped reading, aborting what they left running."""
        now = time.monotonic()
        for subscriber, box in list(self._outboxes.items()):
            if now - box.last_read > idle_s:
                for rid in box.samples_left:
                    self._abort(rid)
                del self._outboxes[subscriber]
                self.kv_log.forget(subscriber)
