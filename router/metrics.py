"""The router's Prometheus metrics, served at `GET /metrics` (torch-free).

One `RouterMetrics` per `Router`, on its own `CollectorRegistry` (several routers may share a
process). Labels: `pool` is the worker's role ("prefill", "decode", "both"), `worker` its id.

- Per request (`router.request_record.RequestRecord`, opened by `Router.generate` once the
  first token arrived): requests by status (success / error with a reason / cancelled), TTFT
  (arrival at the router to the first token, by the worker that sampled it), TPOT, inter-token
  latency and end-to-end latency (by the worker that streamed the rest), prompt, prefix-cached
  and generated tokens; requests, generated tokens, TTFT and end-to-end latency by LoRA adapter
  (`cleave_lora_*`, `adapter`: its served name; the base model's requests are not in them).
  Errors raised before a request reached a worker are counted by the front ends
  (`count_error`), with empty `pool` and `worker`.
- KV handoffs (`kv_transferred`, `kv_transfer_failed`, from `router.orchestrator`): bytes (blocks x
  layers x K and V x block_size x heads x head_dim x dtype size: `KVHandoff.num_bytes`),
  and the handoff latency as the router sees it: from giving the decode worker the handoff to its
  first event (pull, any queueing, one decode step; the worker's own pull time does not cross
  `WorkerClient`).
- On each scrape (`exposition`): every worker's queue depth, running sequences, KV occupancy
  and health as the worker set last heard them (`router.workers.WorkerSet`, pushed by the
  workers), workers per pool, requests in flight, and the `RouterCounters` (fallbacks and
  aggregated requests by reason, disaggregated requests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.counters import RouterCounters
from router.errors import APIError
from router.workers import WorkerSet

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff

logger = logging.getLogger(__name__)

NO_WORKER = ""  # the pool and worker labels of a request refused before routing

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
               120.0, 240.0, 480.0)
HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)
_ERROR_REASONS = {400: "bad_request", 401: "unauthorized", 404: "not_found",
                  413: "request_too_large", 429: "overloaded", 503: "no_healthy_worker"}


def error_reason(exc: BaseException) -> str:
    """The `reason` label of a failed request: the API error's kind, or `worker_error`."""
    if isinstance(exc, APIError):
        return _ERROR_REASONS.get(exc.status, "internal")
    return "worker_error"


class RouterMetrics:
    """The metrics of one `Router`; `exposition()` is the `/metrics` body."""

    def __init__(self, workers: WorkerSet, counters: RouterCounters,
                 in_flight: Callable[[], int]) -> None:
        """`in_flight`: the requests admitted and not yet finished, read at each scrape."""
        self.workers = workers
        self.registry = CollectorRegistry()
        worker = ("pool", "worker")
        reg = self.registry
        self.requests = Counter("cleave_requests", "Requests by how they ended: status is "
                                "success, error (reason says why) or cancelled",
                                ("frontend", *worker, "status", "reason"), registry=reg)
        self.ttft = Histogram("cleave_time_to_first_token_seconds", "From the request reaching "
                              "the router to its first token", worker, buckets=TTFT_BUCKETS,
                              registry=reg)
        self.tpot = Histogram("cleave_time_per_output_token_seconds", "Per request: (last token "
                              "- first token) / (output tokens - 1)", worker,
                              buckets=TOKEN_BUCKETS, registry=reg)
        self.itl = Histogram("cleave_inter_token_latency_seconds", "Between consecutive token "
                             "events of one sample", worker, buckets=TOKEN_BUCKETS, registry=reg)
        self.e2e = Histogram("cleave_e2e_request_latency_seconds", "From the request reaching "
                             "the router to its end (any status)", worker, buckets=E2E_BUCKETS,
                             registry=reg)
        self.prompt_tokens = Counter("cleave_prompt_tokens", "Prompt tokens, by the worker "
                                     "that prefilled them", worker, registry=reg)
        self.predicted_cached = Counter("cleave_prefix_predicted_tokens", "Prompt tokens the "
                                        "router's prefix index expected cached", worker,
                                        registry=reg)
        self.cached = Counter("cleave_prefix_cached_tokens", "Prompt tokens the worker served "
                              "from its prefix cache", worker, registry=reg)
        self.generation_tokens = Counter("cleave_generation_tokens", "Output tokens streamed",
                                         worker, registry=reg)
        self.kv_bytes = Counter("cleave_kv_transfer_bytes", "KV bytes handed to decode workers",
                                worker, registry=reg)
        self.kv_handoff = Histogram("cleave_kv_handoff_seconds", "From giving a decode worker a "
                                    "KV handoff to its first event (pull, queueing, one step)",
                                    worker, buckets=HANDOFF_BUCKETS, registry=reg)
        self.kv_failures = Counter("cleave_kv_transfer_failures", "KV pulls that failed (the "
                                   "decode worker prefilled instead), by reason",
                                   (*worker, "reason"), registry=reg)
        self.lora_requests = Counter("cleave_lora_requests", "Requests under a LoRA adapter by "
                                     "how they ended (status as cleave_requests)",
                                     ("adapter", "status"), registry=reg)
        self.lora_generation_tokens = Counter("cleave_lora_generation_tokens", "Output tokens "
                                              "streamed under a LoRA adapter", ("adapter",),
                                              registry=reg)
        self.lora_ttft = Histogram("cleave_lora_time_to_first_token_seconds", "TTFT (as "
                                   "cleave_time_to_first_token_seconds) of requests under a "
                                   "LoRA adapter", ("adapter",), buckets=TTFT_BUCKETS,
                                   registry=reg)
        self.lora_e2e = Histogram("cleave_lora_e2e_request_latency_seconds", "End-to-end "
                                  "latency (as cleave_e2e_request_latency_seconds) of requests "
                                  "under a LoRA adapter", ("adapter",), buckets=E2E_BUCKETS,
                                  registry=reg)
        reg.register(_LoadCollector(workers, counters, in_flight))

    def pool_of(self, worker_id: str) -> str:
        """The worker's role, as the `pool` label."""
        info = self.workers.infos.get(worker_id)
        return "unknown" if info is None else info.role.value

    def labels(self, worker_id: str) -> tuple[str, str]:
        return self.pool_of(worker_id), worker_id

    def count_error(self, frontend: str, exc: BaseException) -> None:
        """A request that failed before any worker streamed it (refused, rejected, no worker)."""
        self.requests.labels(frontend, NO_WORKER, NO_WORKER, "error", error_reason(exc)).inc()

    def kv_transferred(self, decode_id: str, handoff: KVHandoff, seconds: float) -> None:
        labels = self.labels(decode_id)
        self.kv_bytes.labels(*labels).inc(handoff.num_bytes)
        self.kv_handoff.labels(*labels).observe(seconds)

    def kv_transfer_failed(self, decode_id: str, kind: str) -> None:
        """`kind`: `KVPullFailed.kind` (a transfer error's class name, KVCacheFull, ...)."""
        self.kv_failures.labels(*self.labels(decode_id), kind).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _LoadCollector(Collector):
    """Worker load (as the worker set last heard it) and the router's counters."""

    def __init__(self, workers: WorkerSet, counters: RouterCounters,
                 in_flight: Callable[[], int]) -> None:
        self.workers = workers
        self.counters = counters
        self.in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "worker"]
        up = GaugeMetricFamily("cleave_worker_up", "1 when the worker gave its stats at the "
                               "last scrape", labels=labels)
        waiting = GaugeMetricFamily("cleave_worker_num_waiting", "Requests queued on the "
                                    "worker, not yet scheduled", labels=labels)
        running = GaugeMetricFamily("cleave_worker_num_running", "Sequences being prefilled "
                                    "or decoded on the worker", labels=labels)
        kv = GaugeMetricFamily("cleave_worker_kv_usage", "Fraction of the worker's KV blocks "
                               "held by requests, 0 to 1", labels=labels)
        lora_loads = CounterMetricFamily("cleave_worker_lora_adapter_loads", "LoRA adapters "
                                         "copied into the worker's device slots (a slot taken "
                                         "from another adapter included)", labels=labels)
        pools: dict[str, int] = {}
        w = self.workers
        for wid, info in w.infos.items():
            pool, s = info.role.value, w.stats(wid)
            pools[pool] = pools.get(pool, 0) + 1
            up.add_metric([pool, wid], 1.0 if w.is_healthy(wid) else 0.0)
            if s is not None:
                waiting.add_metric([pool, wid], s.num_waiting)
                running.add_metric([pool, wid], s.num_running)
                kv.add_metric([pool, wid], s.kv_usage)
                lora_loads.add_metric([pool, wid], s.num_lora_loads)
        workers = GaugeMetricFamily("cleave_pool_workers", "Workers (replicas) per pool",
                                    labels=["pool"])
        for pool, n in sorted(pools.items()):
            workers.add_metric([pool], n)
        yield from (up, waiting, running, kv, lora_loads, workers)
        yield from _speculation(w)
        yield GaugeMetricFamily("cleave_router_in_flight", "Requests admitted and not yet "
                                "finished", value=self.in_flight())
        c = self.counters
        yield _by_reason("cleave_fallbacks", "Failures worked around, by reason", c.fallbacks)
        yield _by_reason("cleave_aggregated_requests", "Requests of a deployment with prefill "
                         "workers that ran on one worker, by reason", c.aggregated)
        yield CounterMetricFamily("cleave_disaggregated_requests", "Requests whose first token "
                                  "came from a prefill worker", value=c.num_disaggregated)
        yield from _kv_moves(c)


def _speculation(w: WorkerSet) -> Iterator[Metric]:
    """Speculative decoding's drafted and accepted tokens per worker and method (as vLLM's
    spec_decode counters), from the workers' stats."""
    labels = ["pool", "worker", "method"]
    drafted = CounterMetricFamily("cleave_spec_decode_num_draft_tokens", "Drafted tokens "
                                  "verified by the target model", labels=labels)
    accepted = CounterMetricFamily("cleave_spec_decode_num_accepted_tokens", "Drafted tokens "
                                   "the target model accepted", labels=labels)
    drafts = CounterMetricFamily("cleave_spec_decode_num_drafts", "Drafts verified (one a "
                                 "drafting request a step)", labels=labels)
    for wid, info in w.infos.items():
        s = w.stats(wid)
        if s is not None and s.speculative_method is not None:
            key = [info.role.value, wid, s.speculative_method]
            drafted.add_metric(key, s.num_draft_tokens)
            accepted.add_metric(key, s.num_accepted_tokens)
            drafts.add_metric(key, s.num_drafts)
    yield from (drafted, accepted, drafts)


def _kv_moves(c: RouterCounters) -> Iterator[Metric]:
    """KV moved between workers instead of recomputed (issue 23's counters)."""
    for name, doc, value in (
            ("cleave_prefix_fetches", ("Requests whose worker pulled their prompt's leading "
                                       "blocks from another worker's cache"),
             c.num_prefix_fetches),
            ("cleave_prefix_fetch_blocks", "KV blocks those fetches offered",
             c.prefix_fetch_blocks),
            ("cleave_live_migrations", "Running streams moved to another worker with their KV",
             c.num_live_migrations),
            ("cleave_live_migrations_failed", "Streams that could not move with their KV",
             c.num_live_migrations_failed),
            ("cleave_rebalanced_streams", ("Live migrations off a worker whose KV cache was "
                                           "nearly full"), c.num_rebalanced),
            ("cleave_hand_off_prefixes", ("A leaving worker's hot prefixes pulled by the "
                                          "workers that stay"), c.num_hand_off_prefixes),
            ("cleave_hand_off_blocks", "KV blocks those hand-offs landed", c.hand_off_blocks)):
        yield CounterMetricFamily(name, doc, value=value)


def _by_reason(name: str, documentation: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["reason"])
    for reason, n in sorted(counts.items()):
        family.add_metric([reason], n)
    return family


__all__ = ["RouterMetrics", "error_reason"]
