"""Where a request runs, and starting it: on one worker (aggregated) or split between a prefill
and a decode worker joined by a KV handoff (disaggregated). Torch-free.

The disaggregated path (docs/architecture.md, "One request, step by step"):

1. The routing policy picks a prefill worker from the prefill pool (prefix-aware; it may have
   the worker pull the prompt's leading blocks from another's cache: `router.prefix_fetch`);
   the decode policy (`router.decode_policy`, least loaded by default) picks a decode worker
   from the decode pool ("decode" and "both" workers), counted against it at once. Loads are
   the ones the workers pushed (`router.workers.WorkerSet`).
2. The split policy (`router.split_policy`; by default: when the uncached part of the prompt
   is shorter than `RouterConfig.disagg_threshold_tokens`) may keep the request whole on a
   decode-pool worker instead; so may the lack of a healthy prefill worker, and requests with
   n > 1 or prompt_logprobs always run whole (the handoff carries one sample and no prompt
   logprobs).
3. The prefill worker returns the first token (streamed to the client at once) and a typed
   `KVHandoff`; a prefill that fails before its first token is retried on another prefill worker
   (`RouterConfig.prefill_retries` times), then the request runs aggregated. Meanwhile a
   request under a LoRA adapter has the decode worker checked for it (`supply`: given it when
   it lacks it), so the handoff's decode runs under the same adapter.
4. The decode worker pulls the KV and streams the rest (`router.streams.Generation`, built by
   `router.generations.GenerationFactory` from the `Start` made here): a failed pull makes it
   compute the prompt itself; a worker failing mid-stream moves the stream to another
   decode-pool worker (`router.failover`); closing the generation aborts it everywhere.

Every fallback is counted by reason in `RouterCounters.fallbacks`, every aggregated request of
a disaggregated deployment by reason in `RouterCounters.aggregated`."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from router.config import RouterConfig
from router.counters import RouterCounters
from router.deadline import pools_within
from router.decode_policy import DecodePick
from router.errors import (
    NoHealthyWorkerError,
    OverloadedError,
    WorkerUnavailableError,
    refused,
)
from router.failover import DECODE_POOL
from router.generations import GenerationFactory
from router.loads import LoadTable
from router.policies import Policies
from router.policy import Decision, NoHealthyWorker
from router.prefix_fetch import prefix_to_fetch
from router.starts import DONE, Handover, Start
from router.stream_trace import routed, routed_whole
from router.streams import Generation
from router.worker_client import TokenStream, WorkerClient
from router.workers import WorkerSet
from workers.contract.messages import PrefillResult, PrefixFetch
from workers.contract.protocol import (
    EngineOverloaded,
    InvalidRequestError,
    TokenEvent,
    WorkerRequest,
    WorkerRole,
)
from workers.contract.prefix_cache import adapter_salt, hash_prompt_blocks
from workers.contract.tracing import tracing

logger = logging.getLogger(__name__)

PREFILL_POOL = (WorkerRole.PREFILL,)
# gives a worker a LoRA adapter it lacks before a request under it goes there
Supply = Callable[[WorkerClient, str], Awaitable[None]]


class Orchestrator:
    """Routes and starts requests over a `WorkerSet`; `generations` builds what it started."""

    def __init__(self, workers: WorkerSet, config: RouterConfig, policies: Policies,
                 counters: RouterCounters, generations: GenerationFactory,
                 supply: Supply | None = None) -> None:
        """`supply`: makes a handoff's decode worker hold the request's LoRA adapter
        (`router.adapters.ServedAdapters.supply`); None: not checked."""
        self.workers = workers
        self.supply = supply
        self.config = config
        self.policy = policies.route
        self.split = policies.split
        self.decode = policies.decode
        self.counters = counters
        self.generations = generations

    @property
    def block_size(self) -> int:
        return self.workers.any_info.block_size

    async def generate(self, req: WorkerRequest, started: float | None = None,
                       frontend: str = "other",
                       ttft_deadline_s: float | None = None) -> Generation:
        """Route and start `req`; returns once its first token arrived. `started`, `frontend`:
        for its metrics (`GenerationFactory.build`); `ttft_deadline_s`: the request's own TTFT
        target (`router.deadline`). Raises `BadRequestError` (a worker refused it;
        `NotFoundError`: the adapter it names), `OverloadedError` or `NoHealthyWorkerError`."""
        start = await self.start(req, ttft_deadline_s)
        return self.generations.build(req, start, started, frontend)

    async def start(self, req: WorkerRequest, ttft_deadline_s: float | None = None) -> Start:
        """`req` routed, and started where it runs (see the module's steps)."""
        w = self.workers
        hashes = hash_prompt_blocks(req.prompt_token_ids, self.block_size,
                                    adapter_salt(req.cache_salt, req.lora_name))
        prefill_loads = w.pool_loads(*PREFILL_POOL)
        decode_loads = w.pool_loads(*DECODE_POOL)
        split = bool(prefill_loads)
        with tracing().span("router.admission", attributes={"disaggregated": split}):
            self._admit(prefill_loads or decode_loads)
            if ttft_deadline_s is not None:  # only the workers that can meet it (else 429)
                prefill_loads, decode_loads = pools_within(
                    ttft_deadline_s, prefill_loads, decode_loads, len(req.prompt_token_ids),
                    self.config.retry_after_s, self.counters)
        if not prefill_loads:  # an aggregated deployment, or no prefill worker in time
            return await self._aggregated(req, hashes, decode_loads,
                                          "deadline" if split else None)
        if req.params.n > 1 or req.params.prompt_logprobs is not None:
            return await self._aggregated(req, hashes, decode_loads, "unsupported_params")
        tried: set[str] = set()
        for attempt in range(1 + self.config.prefill_retries):
            decode_loads = decode_loads.without(())  # routing awaits: one may be gone
            try:
                with tracing().span("router.route", attributes={"attempt": attempt}) as span:
                    decision = self.policy.choose(hashes, prefill_loads.without(tried), w.index,
                                                  req.lora_name)
                    cached = decision.predicted_hit_blocks * self.block_size
                    reason = self.split.run_here(req, cached) if attempt == 0 else None
                    decode = None if reason else self._pick_decode(req, hashes, decode_loads)
                    if span is not None:
                        span.set_attributes(routed(decision.worker_id, cached, reason, decode))
            except NoHealthyWorker:
                if attempt > 0:
                    break  # every healthy prefill worker failed
                self.counters.count_fallback("no_prefill_worker")
                return await self._aggregated(req, hashes, decode_loads, "no_prefill_worker")
            if decode is None:
                return await self._aggregated(req, hashes, decode_loads, reason)
            try:
                start = await self._try_prefill(req, hashes, decision, decode.worker_id)
            finally:
                decode.release()  # sent (the worker set counts it now), or not sent at all
            if start is not None:
                return start
            tried.add(decision.worker_id)
        self.counters.count_fallback("prefill_failed")
        return await self._aggregated(req, hashes, decode_loads, "prefill_failed")

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

    def _pick_decode(self, req: WorkerRequest, hashes: Sequence[int],
                     loads: LoadTable) -> DecodePick:
        try:
            return self.decode.pick(hashes, loads, self.workers.index, req.lora_name)
        except NoHealthyWorker as exc:
            raise NoHealthyWorkerError(f"no healthy worker can take the request: {exc}") from None

    async def _try_prefill(self, req: WorkerRequest, hashes: Sequence[int], decision: Decision,
                           decode_id: str) -> Start | None:
        """The disaggregated start, or None when the prefill worker failed (counted); the
        prefill worker first pulls the prefix the decision names (`router.prefix_fetch`)."""
        w = self.workers
        prefill, decode = w.clients[decision.worker_id], w.clients[decode_id]
        d_tp = w.info(decode_id).tp_size
        w.note_routed(prefill.worker_id, req.lora_name)
        supplied = (asyncio.ensure_future(self.supply(decode, req.lora_name))  # beside prefill
                    if self.supply is not None and req.lora_name is not None else None)
        prefix = (await prefix_to_fetch(w, self.counters, req, hashes, decision)
                  if decision.fetch_from is not None else None)
        try:  # each prefill rank's KV is read by as many decode ranks as share its heads
            with tracing().span("router.prefill_call", attributes={
                    "prefill_worker": prefill.worker_id, "decode_worker": decode_id}):
                result: PrefillResult = await prefill.prefill(req, d_tp, prefix)
        except InvalidRequestError as exc:
            raise refused(exc.message, exc.param) from None
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
            return Start(first, DONE, prefill.worker_id, cached)
        w.note_routed(decode_id, req.lora_name)
        if supplied is not None:
            await supplied
        stream = decode.decode_from_handoff(req, first.token_ids[-1], result.handoff)
        return Start(first, stream, prefill.worker_id, cached, decode_id,
                     Handover(prefill, decode, result.handoff, time.monotonic()))

    async def _aggregated(self, req: WorkerRequest, hashes: Sequence[int],
                          loads: LoadTable, reason: str | None) -> Start:
        """The whole request on one decode-pool worker; a worker that is unreachable, going
        away or overloaded before the first token is left for another
        (`RouterConfig.start_retries` more)."""
        if reason is not None:
            self.counters.count_aggregated(reason)
        failed: list[Exception] = []
        tried: set[str] = set()
        for attempt in range(1 + self.config.start_retries):
            try:
                with tracing().span("router.route", attributes={"attempt": attempt}) as span:
                    decision = self.policy.choose(hashes, loads.without(tried),
                                                  self.workers.index, req.lora_name)
                    if span is not None:
                        span.set_attributes(routed_whole(
                            decision.worker_id, decision.predicted_hit_blocks * self.block_size,
                            reason))
            except NoHealthyWorker as exc:
                if failed:
                    break
                raise NoHealthyWorkerError(
                    f"no healthy worker can take the request: {exc}") from None
            wid = decision.worker_id
            self.workers.note_routed(wid, req.lora_name)
            prefix = (await prefix_to_fetch(self.workers, self.counters, req, hashes, decision)
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
            return Start(first, stream, wid, decision.predicted_hit_blocks * self.block_size, wid)
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
            raise refused(exc.message, exc.param) from None
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


__all__ = ["DECODE_POOL", "PREFILL_POOL", "Orchestrator", "Policies"]
