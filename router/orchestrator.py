"""Where a request runs, and starting it: on one worker (aggregated) or split between a prefill
and a decode worker joined by a KV handoff (disaggregated). Torch-free.

The disaggregated path (docs/architecture.md, "One request, step by step"):

1. The routing policy picks a prefill worker from the prefill pool (prefix-aware; it may have
   the worker pull the prompt's leading blocks from another's cache: `router.prefix_fetch`);
   the least loaded decode worker is picked from the decode pool ("decode" and "both"
   workers). Loads are the ones the workers pushed (`router.workers.WorkerSet`).
2. When the uncached part of the prompt (prompt tokens minus the predicted prefix hit) is
   shorter than `RouterConfig.disagg_threshold_tokens`, or no prefill worker is healthy, the
   whole request runs on a decode-pool worker instead; so do requests with n > 1 or
   prompt_logprobs (the handoff carries one sample and no prompt logprobs).
3. The prefill worker returns the first token (streamed to the client at once) and a typed
   `KVHandoff`; a prefill that fails before its first token is retried on another prefill worker
   (`RouterConfig.prefill_retries` times), then the request runs aggregated.
4. The decode worker pulls the KV and streams the rest (`router.streams.Generation`): a failed
   pull makes it compute the prompt itself; a worker failing mid-stream moves the stream to
   another decode-pool worker (`migrate`); closing the generation aborts it everywhere.

Every fallback is counted by reason in `RouterCounters.fallbacks`, every aggregated request of
a disaggregated deployment by reason in `RouterCounters.aggregated`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Collection, Sequence

from router.config import RouterConfig
from router.counters import RouterCounters
from router.errors import (
    BadRequestError,
    NoHealthyWorkerError,
    OverloadedError,
    WorkerUnavailableError,
)
from router.loads import LoadTable
from router.metrics import RouterMetrics
from router.policy import Decision, NoHealthyWorker, RoutingPolicy, get_policy
from router.prefix_fetch import export_prefix
from router.streams import DONE, Generation, Handover
from router.worker_client import TokenStream, WorkerClient
from router.workers import WorkerSet
from workers.contract.messages import PrefillResult, PrefixFetch, ResumedSample
from workers.contract.protocol import (
    EngineOverloaded,
    InvalidRequestError,
    KVPullFailed,
    TokenEvent,
    WorkerRequest,
    WorkerRole,
)
from workers.contract.prefix_cache import hash_prompt_blocks

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff

logger = logging.getLogger(__name__)

PREFILL_POOL = (WorkerRole.PREFILL,)
DECODE_POOL = (WorkerRole.DECODE, WorkerRole.BOTH)
MIGRATION_POLL_S = 0.25  # how often a stream waiting to migrate looks for a worker again


class Orchestrator:
    """Routes and starts requests over a `WorkerSet`; implements `router.streams.Rerouter`."""

    def __init__(self, workers: WorkerSet, config: RouterConfig, policy: RoutingPolicy,
                 counters: RouterCounters, metrics: RouterMetrics,
                 tokenizer: object | None = None) -> None:
        """`tokenizer`: the generations make their events' text with it (None: the workers')."""
        self.tokenizer = tokenizer
        self.workers = workers
        self.config = config
        self.policy = policy
        self.counters = counters
        self.metrics = metrics
        self.least_loaded = get_policy("least_loaded")

    @property
    def block_size(self) -> int:
        return self.workers.any_info.block_size

    async def generate(self, req: WorkerRequest) -> Generation:
        """Route and start `req`; returns once its first token arrived. Raises
        `BadRequestError` (a worker refused it) or `NoHealthyWorkerError`."""
        w = self.workers
        hashes = hash_prompt_blocks(req.prompt_token_ids, self.block_size, req.cache_salt)
        prefill_loads = w.pool_loads(*PREFILL_POOL)
        decode_loads = w.pool_loads(*DECODE_POOL)
        self._admit(prefill_loads or decode_loads)
        if not prefill_loads:  # an aggregated deployment
            return await self._aggregated(req, hashes, decode_loads, None)
        if req.params.n > 1 or req.params.prompt_logprobs is not None:
            return await self._aggregated(req, hashes, decode_loads, "unsupported_params")
        tried: set[str] = set()
        for attempt in range(1 + self.config.prefill_retries):
            candidates = self._present(prefill_loads, tried)
            decode_loads = self._present(decode_loads, ())
            try:
                decision = self.policy.choose(hashes, candidates, w.index)
            except NoHealthyWorker:
                if attempt > 0:
                    break  # every healthy prefill worker failed
                self.counters.count_fallback("no_prefill_worker")
                return await self._aggregated(req, hashes, decode_loads, "no_prefill_worker")
            uncached = len(req.prompt_token_ids) - decision.predicted_hit_blocks * self.block_size
            if attempt == 0 and uncached < self.config.disagg_threshold_tokens:
                return await self._aggregated(req, hashes, decode_loads, "short_prompt")
            decode = self._choose(hashes, decode_loads, self.least_loaded)
            gen = await self._try_prefill(req, hashes, decision, decode.worker_id)
            if gen is not None:
                return gen
            tried.add(decision.worker_id)
        self.counters.count_fallback("prefill_failed")
        return await self._aggregated(req, hashes, decode_loads, "prefill_failed")

    def _present(self, loads: LoadTable, tried: Collection[str]) -> LoadTable:
        """The workers still in the set and not tried yet (routing awaits: one may be gone)."""
        return loads.without(tried)

    def _admit(self, loads: LoadTable) -> None:
        """Refuse the request (429) when every healthy worker that would queue its prompt
        already has `RouterConfig.max_waiting_per_worker` requests or
        `max_pending_tokens_per_worker` prompt tokens waiting, as they last reported plus what
        was routed to them since; no healthy worker at all is left to the routing (503)."""
        cfg = self.config
        room = loads.any_with_room(cfg.max_waiting_per_worker,
                                   cfg.max_pending_tokens_per_worker)
        if room is None or room:
            return
        healthy = loads.healthy_rows()
        self.counters.num_refused_overloaded += 1
        raise OverloadedError(
            f"every worker's queue is full ({len(healthy)} workers, each with at least "
            f"{cfg.max_waiting_per_worker} requests or {cfg.max_pending_tokens_per_worker} "
            f"prompt tokens waiting); retry after {cfg.retry_after_s} s",
            headers={"Retry-After": str(cfg.retry_after_s)})

    def _choose(self, hashes: Sequence[int], loads: LoadTable,
                policy: RoutingPolicy) -> Decision:
        try:
            return policy.choose(hashes, loads, self.workers.index)
        except NoHealthyWorker as exc:
            raise NoHealthyWorkerError(f"no healthy worker can take the request: {exc}") from None

    async def _try_prefill(self, req: WorkerRequest, hashes: Sequence[int], decision: Decision,
                           decode_id: str) -> Generation | None:
        """The disaggregated generation, or None when the prefill worker failed (counted); the
        prefill worker first pulls the prefix the decision names (`router.prefix_fetch`)."""
        w = self.workers
        prefill, decode = w.clients[decision.worker_id], w.clients[decode_id]
        d_tp = w.info(decode_id).tp_size
        w.note_routed(prefill.worker_id)
        prefix = (await export_prefix(w, self.counters, req, hashes, decision)
                  if decision.fetch_from is not None else None)
        try:  # each prefill rank's KV is read by as many decode ranks as share its heads
            result: PrefillResult = await prefill.prefill(req, d_tp, prefix)
        except InvalidRequestError as exc:
            raise BadRequestError(exc.message, param=exc.param) from None
        except Exception as exc:  # noqa: BLE001 -- any worker failure: try another one
            logger.warning("prefill of %s on %s failed: %r", req.request_id, prefill.worker_id,
                           exc)
            if isinstance(exc, WorkerUnavailableError):
                w.mark_unhealthy(prefill.worker_id)
            self.counters.count_fallback("prefill_error")
            return None
        first = result.first
        self._count(req, decision, first, decode_id, prefix)
        self.counters.num_disaggregated += 1
        cached = decision.predicted_hit_blocks * self.block_size
        if result.handoff is None:  # finished at its first token
            return Generation(req, first, DONE, worker_id=prefill.worker_id,
                              predicted_cached_tokens=cached, rerouter=self,
                              tokenizer=self.tokenizer)
        w.note_routed(decode_id)
        stream = decode.decode_from_handoff(req, first.token_ids[-1], result.handoff)
        return Generation(req, first, stream, worker_id=prefill.worker_id,
                          predicted_cached_tokens=cached, rerouter=self,
                          decode_worker_id=decode_id,
                          handover=Handover(prefill, decode, result.handoff, time.monotonic()),
                          migration_retries=self.config.migration_retries,
                          tokenizer=self.tokenizer)

    async def _aggregated(self, req: WorkerRequest, hashes: Sequence[int],
                          loads: LoadTable, reason: str | None) -> Generation:
        """The whole request on one decode-pool worker; a worker that is unreachable, going
        away or overloaded before the first token is left for another
        (`RouterConfig.start_retries` more)."""
        if reason is not None:
            self.counters.count_aggregated(reason)
        failed: list[Exception] = []
        tried: set[str] = set()
        for _ in range(1 + self.config.start_retries):
            candidates = self._present(loads, tried)
            try:
                decision = self.policy.choose(hashes, candidates, self.workers.index)
            except NoHealthyWorker as exc:
                if failed:
                    break
                raise NoHealthyWorkerError(
                    f"no healthy worker can take the request: {exc}") from None
            wid = decision.worker_id
            self.workers.note_routed(wid)
            prefix = (await export_prefix(self.workers, self.counters, req, hashes, decision)
                      if decision.fetch_from is not None else None)
            stream = self.workers.clients[wid].generate(req, prefix)
            try:
                first = await self._first_event(stream, wid)
            # not an engine error: a request that broke one worker's step is not spread to more
            except (WorkerUnavailableError, EngineOverloaded) as exc:
                logger.warning("request %s did not start on %s: %r", req.request_id, wid, exc)
                self.counters.count_fallback("start_failed")
                tried.add(wid)
                failed.append(exc)
                continue
            self._count(req, decision, first, wid, prefix)
            return Generation(req, first, stream, worker_id=wid,
                              predicted_cached_tokens=decision.predicted_hit_blocks
                              * self.block_size, rerouter=self, decode_worker_id=wid,
                              migration_retries=self.config.migration_retries,
                              tokenizer=self.tokenizer)
        if all(isinstance(exc, EngineOverloaded) for exc in failed):
            self.counters.num_refused_overloaded += 1
            raise OverloadedError(
                f"every worker tried ({', '.join(sorted(tried))}) refused the request as "
                f"overloaded; retry after {self.config.retry_after_s} s",
                headers={"Retry-After": str(self.config.retry_after_s)})
        raise NoHealthyWorkerError(
            f"the request could not start on any worker (tried {', '.join(sorted(tried))})")

    async def _first_event(self, stream: TokenStream, worker_id: str) -> TokenEvent:
        """The stream's first event; a refusal as a 400. An unreachable worker is marked
        down; its error, an overload or an engine failure is raised for a retry elsewhere."""
        try:
            return await stream.__anext__()
        except InvalidRequestError as exc:
            await stream.aclose()
            raise BadRequestError(exc.message, param=exc.param) from None
        except WorkerUnavailableError:
            await stream.aclose()
            self.workers.mark_unhealthy(worker_id)
            raise
        except BaseException:
            await stream.aclose()
            raise

    def _count(self, req: WorkerRequest, decision: Decision, first: TokenEvent,
               decode_id: str, prefix: PrefixFetch | None = None) -> None:
        c = self.counters
        if prefix is not None:  # what the pull brought beyond the worker's own blocks
            c.prefix_fetch_blocks_hit += max(
                0, first.num_cached_tokens // self.block_size - decision.predicted_hit_blocks)
        c.num_requests += 1
        c.num_prompt_tokens += len(req.prompt_token_ids)
        c.num_predicted_cached_tokens += decision.predicted_hit_blocks * self.block_size
        c.num_cached_tokens += first.num_cached_tokens
        c.first_tokens_by_worker[decision.worker_id] = (
            c.first_tokens_by_worker.get(decision.worker_id, 0) + 1)
        c.count_decode(decode_id)

    # ---- `router.streams.Rerouter` -------------------------------------------------------------

    async def migrate(self, req: WorkerRequest, samples: list[ResumedSample], tried: list[str],
                      exc: Exception) -> tuple[str, TokenStream]:
        """Resume the samples on another healthy decode-pool worker, waiting up to
        `migration_wait_s` for one (a cluster's pool replaces its lost replicas); raise `exc`
        when none comes."""
        w = self.workers
        if isinstance(exc, WorkerUnavailableError) and tried:
            w.mark_unhealthy(tried[-1])
        hashes = hash_prompt_blocks(req.prompt_token_ids, self.block_size, req.cache_salt)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.migration_wait_s
        while True:
            loads = w.pool_loads(*DECODE_POOL).without(tried)
            try:
                decision = self.policy.choose(hashes, loads, w.index)
                break
            except NoHealthyWorker:
                if loop.time() >= deadline:
                    raise exc from None
                await asyncio.sleep(MIGRATION_POLL_S)
        self.counters.count_fallback("decode_worker_failed")
        self.counters.count_decode(decision.worker_id)
        w.note_routed(decision.worker_id)
        client: WorkerClient = w.clients[decision.worker_id]
        return decision.worker_id, client.resume(req, samples)

    def kv_pulled(self, decode_id: str, handoff: KVHandoff, seconds: float) -> None:
        self.metrics.kv_transferred(decode_id, handoff, seconds)

    def kv_pull_failed(self, decode_id: str, exc: KVPullFailed) -> None:
        self.counters.count_fallback("kv_pull_failed")
        self.metrics.kv_transfer_failed(decode_id, exc.kind)


__all__ = ["DECODE_POOL", "Generation", "Orchestrator", "PREFILL_POOL"]
