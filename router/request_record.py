"""One request's timings and outcome as the router's metrics count them (`RequestRecord`,
opened by `router.generations.GenerationFactory` as it builds the generation, `started` being
when the request reached the router, `time.monotonic()`; torch-free)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from workers.contract.protocol import TokenEvent, WorkerRequest

if TYPE_CHECKING:
    from router.metrics import RouterMetrics


class Timed(Protocol):
    """What a request record reads of a generation (`router.streams.Generation`)."""

    req: WorkerRequest
    worker_id: str  # sampled the first token
    decode_worker_id: str | None  # streams the rest, when set
    predicted_cached_tokens: int
    num_cached_tokens: int
    first: TokenEvent

    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...


class NullRecord:
    """A generation nobody times (built by a factory without metrics)."""

    def on_event(self, event: TokenEvent) -> None:
        """Called for each of the generation's events after the first."""

    def finish(self, status: str, reason: str = "") -> None:
        """Called once it ended. `status`: success, error (with `reason`) or cancelled."""


class RequestRecord(NullRecord):
    """One generation's timings and outcome. `on_event` for each event after the first,
    `finish` once (later calls are ignored)."""

    def __init__(self, metrics: RouterMetrics, gen: Timed, started: float,
                 frontend: str) -> None:
        now = time.monotonic()
        self._metrics = metrics
        self._gen = gen
        self._frontend = frontend
        self._started = started
        self._first_at = now
        self._last_at: dict[int, float] = {}  # sample index -> its last event
        self._tokens: dict[int, int] = {}  # sample index -> tokens so far
        self._done = False
        self._children_of: str | None = None  # the worker `_series` are of
        self._series: tuple[Any, Any] = (None, None)
        m, labels = metrics, metrics.labels(gen.worker_id)
        m.ttft.labels(*labels).observe(now - started)
        if gen.req.lora_name is not None:
            m.lora_ttft.labels(gen.req.lora_name).observe(now - started)
        m.prompt_tokens.labels(*labels).inc(len(gen.prompt_token_ids))
        m.predicted_cached.labels(*labels).inc(gen.predicted_cached_tokens)
        m.cached.labels(*labels).inc(gen.num_cached_tokens)
        self._count_tokens(gen.first, now, m.generation_tokens.labels(*labels))
        self._observe_itl(gen.first, None)

    def _count_tokens(self, event: TokenEvent, now: float, counter: Any) -> None:
        self._last_at[event.index] = now
        self._tokens[event.index] = self._tokens.get(event.index, 0) + len(event.token_ids)
        if event.token_ids:
            counter.inc(len(event.token_ids))

    def on_event(self, event: TokenEvent) -> None:
        now = time.monotonic()
        self._observe_itl(event, now - self._last_at.get(event.index, self._first_at))
        self._count_tokens(event, now, self._children()[1])

    def _observe_itl(self, event: TokenEvent, gap: float | None) -> None:
        """One inter-token latency per token: `gap` (since the sample's last event) for the
        event's first token (None: the generation's first, which has none), 0 for the tokens
        that arrived with it."""
        itl = self._children()[0]
        if gap is not None:
            itl.observe(gap)
        for _ in range(len(event.token_ids) - 1):
            itl.observe(0.0)

    def _children(self) -> tuple[Any, Any]:
        """The ITL histogram's and the output-token counter's series of the worker streaming
        now, looked up when that worker changes (a handoff, a migration), not per event."""
        streamer = self._streamer
        if self._children_of != streamer:
            labels = self._metrics.labels(streamer)
            self._series = (self._metrics.itl.labels(*labels),
                            self._metrics.generation_tokens.labels(*labels))
            self._children_of = streamer
        return self._series

    @property
    def _streamer(self) -> str:
        return self._gen.decode_worker_id or self._gen.worker_id

    def finish(self, status: str, reason: str = "") -> None:
        if self._done:
            return
        self._done = True
        m, labels = self._metrics, self._metrics.labels(self._streamer)
        now = time.monotonic()
        m.requests.labels(self._frontend, *labels, status, reason).inc()
        adapter = self._gen.req.lora_name
        if adapter is not None:
            m.lora_requests.labels(adapter, status).inc()
            m.lora_generation_tokens.labels(adapter).inc(sum(self._tokens.values()))
            m.lora_e2e.labels(adapter).observe(now - self._started)
        m.e2e.labels(*labels).observe(now - self._started)
        num_tokens = max(self._tokens.values(), default=0)
        if status == "success" and num_tokens > 1:
            last = max(self._last_at.values())
            m.tpot.labels(*labels).observe((last - self._first_at) / (num_tokens - 1))


NULL_RECORD = NullRecord()
