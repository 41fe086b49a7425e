"""Where a request runs, and running it: on one worker (aggregated) or split between a prefill
and a decode worker joined by a KV handoff (disaggregated). Torch-free.

The disaggregated path (see ARCHITECTURE.md, "One request, step by step"):

1. The routing policy picks a prefill worker from the prefill pool (prefix-aware); the least
   loaded decode worker is picked from the decode pool ("decode" and "both" workers).
2. When the uncached part of the prompt (prompt tokens minus the predicted prefix hit) is
   shorter than `RouterConfig.disagg_threshold_tokens`, or no prefill worker is healthy, the
   whole request runs on a decode-pool worker instead. So do requests with n > 1 or
   prompt_logprobs: the handoff carries one sample and no prompt logprobs.
3. The prefill worker returns the first token (streamed to the client at once) and a handoff;
   a prefill that fails before its first token is retried on another prefill worker
   (`RouterConfig.prefill_retries` times), then the request runs aggregated.
4. The decode worker pulls the KV and streams the rest. When the pull fails, the same decode
   worker computes the prompt's KV itself and continues after the first token (no token is
   repeated or lost), and the prefill worker's lease is released.
5. Closing the generation (client gone) aborts the request on the decode worker and, unless the
   decode side already has the KV, on the prefill worker (which ends the lease).
6. When the worker streaming a request (decode or aggregated, n = 1) fails mid-stream, the
   request migrates: the prompt plus every token already sent goes to another decode-pool
   worker, which computes their KV and streams on from the next token (none repeated or lost;
   greedy output equals an uninterrupted run, seeded sampling may differ), at most
   `RouterConfig.migration_retries` times; after that, or with no worker left, the stream ends
   with the error.

Every fallback is counted by reason in `Router.counters.fallbacks`, every aggregated request of
a disaggregated deployment by reason in `Router.counters.aggregated`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from router.errors import BadRequestError, NoHealthyWorkerError, WorkerUnavailableError
from router.metrics import NULL_RECORD, NullRecord, error_reason
from router.policy import Decision, NoHealthyWorker, RoutingPolicy, WorkerLoad, get_policy
from router.worker_client import (
    HandoffWorkerClient,
    KVPullFailed,
    PrefillResult,
    WorkerRequest,
    WorkerRole,
)
from workers.protocol import InvalidRequestError, TokenEvent, hash_prompt_blocks

if TYPE_CHECKING:
    from router.app import Router

logger = logging.getLogger(__name__)

PREFILL_POOL = (WorkerRole.PREFILL,)
DECODE_POOL = (WorkerRole.DECODE, WorkerRole.BOTH)
MIGRATION_POLL_S = 0.25  # how often a stream waiting to migrate looks for a worker again


class Generation:
    """One request submitted to its worker(s). `events()` yields its token events (the first one
    has already arrived when the `Generation` is returned); `aclose()` aborts what is left.
    `worker_id` sampled the first token; `decode_worker_id`, when set, streams the rest.
    `record` times it and counts how it ended (`router.metrics`)."""

    def __init__(self, router: Router, worker_id: str, prompt_token_ids: list[int],
                 predicted_cached_tokens: int, first: TokenEvent,
                 stream: AsyncIterator[TokenEvent], decode_worker_id: str | None = None) -> None:
        self.worker_id = worker_id
        self.decode_worker_id = decode_worker_id
        self.prompt_token_ids = prompt_token_ids
        self.predicted_cached_tokens = predicted_cached_tokens
        self.num_cached_tokens = first.num_cached_tokens
        self.first = first
        self._router = router
        self._stream = stream
        self._closed = False
        self.record: NullRecord = NULL_RECORD

    async def events(self) -> AsyncIterator[TokenEvent]:
        try:
            yield self.first
            async for event in self._stream:
                self.record.on_event(event)
                yield event
            self.record.finish("success")
        except Exception as exc:
            self.record.finish("error", error_reason(exc))
            raise
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.record.finish("cancelled")  # unless it already ended
        try:
            await self._stream.aclose()  # type: ignore[attr-defined]
        finally:
            streamed_by = [self.decode_worker_id]
            if isinstance(self._stream, _Migration):
                streamed_by = self._stream.worker_ids
            self._router._after_request(self.worker_id)
            for wid in dict.fromkeys(streamed_by):
                if wid not in (None, self.worker_id):
                    self._router._after_request(wid)


class _Handover:
    """The decode half of a disaggregated request, as an async iterator of its events: pull
    (or, when the pull fails, compute) the KV on the decode worker, then stream. Closing it
    before the decode worker has the KV also aborts the request on the prefill worker."""

    def __init__(self, orchestrator: Orchestrator, prefill: HandoffWorkerClient,
                 decode: HandoffWorkerClient, req: WorkerRequest, first_token_id: int,
                 handoff_json: str) -> None:
        self._orchestrator = orchestrator
        self._prefill = prefill
        self._decode = decode
        self._req = req
        self._first_token_id = first_token_id
        self._handoff_json = handoff_json
        self._has_kv = False
        self._events = self._run()

    def __aiter__(self) -> _Handover:
        return self

    async def __anext__(self) -> TokenEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            if not self._has_kv:  # the lease may still hold the prompt's blocks
                await self._prefill.abort(self._req.request_id)

    async def _run(self) -> AsyncIterator[TokenEvent]:
        req, token = self._req, self._first_token_id
        metrics, started = self._orchestrator.router.metrics, time.monotonic()
        stream = self._decode.decode(req, token, self._handoff_json)
        try:
            try:
                event = await stream.__anext__()
                metrics.kv_transferred(self._decode.worker_id, self._handoff_json,
                                       time.monotonic() - started)
            except KVPullFailed as exc:
                logger.warning("request %s: %s; decode worker %s prefills it itself",
                               req.request_id, exc.reason, self._decode.worker_id)
                self._orchestrator.count_fallback("kv_pull_failed")
                metrics.kv_transfer_failed(self._decode.worker_id, exc.reason)
                await stream.aclose()
                await self._prefill.abort(req.request_id)  # ends the lease if the pull left it
                stream = self._decode.decode(req, token, None)
                event = await stream.__anext__()
            self._has_kv = True
            yield event
            async for event in stream:
                yield event
        finally:
            await stream.aclose()  # type: ignore[attr-defined]


class _Migration:
    """The events after a generation's first, moved to another decode-pool worker when the
    worker streaming them fails (step 6 above): `HandoffWorkerClient.resume` gets the prompt
    plus every token sent so far and streams on from the next one. `worker_ids`: the workers
    that streamed part of it, in order (all but the last failed)."""

    def __init__(self, orchestrator: Orchestrator, req: WorkerRequest, first: TokenEvent,
                 stream: AsyncIterator[TokenEvent], worker_id: str) -> None:
        self.worker_ids = [worker_id]
        self._orchestrator = orchestrator
        self._req = req
        self._sent = list(first.token_ids)  # every token the client has been sent
        self._finished = first.finish_reason is not None
        self._stream = stream
        self._events = self._run()

    def __aiter__(self) -> _Migration:
        return self

    async def __anext__(self) -> TokenEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()

    async def _run(self) -> AsyncIterator[TokenEvent]:
        retries = self._orchestrator.router.config.migration_retries
        try:
            while True:
                try:
                    async for event in self._stream:
                        self._sent.extend(event.token_ids)
                        self._finished = event.finish_reason is not None
                        yield event
                    return
                except Exception as exc:  # any worker failure: move the stream on
                    if self._finished or len(self.worker_ids) > retries:
                        raise
                    await self._move(exc)
        finally:
            await self._stream.aclose()  # type: ignore[attr-defined]

    async def _move(self, exc: Exception) -> None:
        """Resubmit to another healthy decode-pool worker (counted), or raise `exc` when none
        is left. Closes the failed stream (aborting what is left of the request there)."""
        o, r = self._orchestrator, self._orchestrator.router
        failed = self.worker_ids[-1]
        logger.warning("request %s: worker %s failed after %d tokens (%r); migrating",
                       self._req.request_id, failed, len(self._sent), exc)
        if isinstance(exc, WorkerUnavailableError):
            r._healthy[failed] = False
        await self._stream.aclose()  # type: ignore[attr-defined]
        self._stream = _empty()
        req = self._req
        hashes = hash_prompt_blocks(list(req.prompt_token_ids), r.block_size, req.cache_salt)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + r.config.migration_wait_s
        while True:  # a pool that lost its last worker gets `migration_wait_s` to replace it
            tried = set(self.worker_ids)
            loads = [load for load in _in_pool(await r._loads(), r.pool(*DECODE_POOL))
                     if load.worker_id not in tried
                     and isinstance(r.clients.get(load.worker_id), HandoffWorkerClient)]
            try:
                decision = r.policy.choose(hashes, loads, r.index)
                break
            except NoHealthyWorker:
                if loop.time() >= deadline:
                    raise exc from None
                await asyncio.sleep(MIGRATION_POLL_S)
        client = r.clients[decision.worker_id]
        if not isinstance(client, HandoffWorkerClient):  # filtered above; for the type checker
            raise exc
        o.count_fallback("decode_worker_failed")
        by_worker = r.counters.decodes_by_worker
        by_worker[decision.worker_id] = by_worker.get(decision.worker_id, 0) + 1
        self.worker_ids.append(decision.worker_id)
        self._stream = client.resume(req, list(self._sent))


class Orchestrator:
    """Routes and submits requests for a `Router` (which owns the clients, the prefix index,
    the health map and the counters)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.least_loaded = get_policy("least_loaded")

    def count_fallback(self, reason: str) -> None:
        fallbacks = self.router.counters.fallbacks
        fallbacks[reason] = fallbacks.get(reason, 0) + 1

    def _count_aggregated(self, reason: str) -> None:
        aggregated = self.router.counters.aggregated
        aggregated[reason] = aggregated.get(reason, 0) + 1

    async def generate(self, req: WorkerRequest) -> Generation:
        """Route and submit `req`; returns once its first token arrived. Raises
        `BadRequestError` (a worker refused it) or `NoHealthyWorkerError`."""
        r = self.router
        ids = list(req.prompt_token_ids)
        hashes = hash_prompt_blocks(ids, r.block_size, req.cache_salt)
        loads = await r._loads()
        prefill_loads = _in_pool(loads, r.pool(*PREFILL_POOL))
        decode_loads = _in_pool(loads, r.pool(*DECODE_POOL))
        if not prefill_loads:  # an aggregated deployment
            return await self._aggregated(req, hashes, decode_loads, None)
        if req.params.n > 1 or req.params.prompt_logprobs is not None:
            return await self._aggregated(req, hashes, decode_loads, "unsupported_params")
        tried: set[str] = set()
        for attempt in range(1 + r.config.prefill_retries):
            candidates = [load for load in prefill_loads if load.worker_id not in tried]
            try:
                decision = r.policy.choose(hashes, candidates, r.index)
            except NoHealthyWorker:
                if attempt > 0:
                    break  # every healthy prefill worker failed
                self.count_fallback("no_prefill_worker")
                return await self._aggregated(req, hashes, decode_loads, "no_prefill_worker")
            uncached = len(ids) - decision.predicted_hit_blocks * r.block_size
            if attempt == 0 and uncached < r.config.disagg_threshold_tokens:
                return await self._aggregated(req, hashes, decode_loads, "short_prompt")
            decode = self._choose(hashes, decode_loads, self.least_loaded)
            gen = await self._try_prefill(req, decision, decode.worker_id)
            if gen is not None:
                return gen
            tried.add(decision.worker_id)
        self.count_fallback("prefill_failed")
        return await self._aggregated(req, hashes, decode_loads, "prefill_failed")

    def _choose(self, hashes: Sequence[int], loads: list[WorkerLoad],
                policy: RoutingPolicy) -> Decision:
        try:
            return policy.choose(hashes, loads, self.router.index)
        except NoHealthyWorker as exc:
            raise NoHealthyWorkerError(f"no healthy worker can take the request: {exc}") from None

    async def _try_prefill(self, req: WorkerRequest, decision: Decision,
                           decode_id: str) -> Generation | None:
        """The disaggregated generation, or None when the prefill worker failed (counted)."""
        r = self.router
        prefill = r.clients[decision.worker_id]
        decode = r.clients[decode_id]
        if not (isinstance(prefill, HandoffWorkerClient)
                and isinstance(decode, HandoffWorkerClient)):
            raise TypeError(f"workers {prefill.worker_id!r} and {decode_id!r} must be "
                            f"HandoffWorkerClients to split a request between them")
        p_tp, d_tp = r._infos[prefill.worker_id].tp_size, r._infos[decode_id].tp_size
        try:  # each prefill rank's KV is read by as many decode ranks as share its heads
            result: PrefillResult = await prefill.prefill(req, max(1, d_tp // p_tp))
        except InvalidRequestError as exc:
            raise BadRequestError(exc.message, param=exc.param) from None
        except Exception as exc:  # noqa: BLE001 -- any worker failure: try another one
            logger.warning("prefill of %s on %s failed: %r", req.request_id, prefill.worker_id,
                           exc)
            if isinstance(exc, WorkerUnavailableError):
                r._healthy[prefill.worker_id] = False
            self.count_fallback("prefill_error")
            return None
        first = result.first
        self._count(req, decision, first, decode_id)
        r.counters.num_disaggregated += 1
        if result.handoff_json is None:  # finished at its first token
            return Generation(r, prefill.worker_id, list(req.prompt_token_ids),
                              decision.predicted_hit_blocks * r.block_size, first, _empty())
        handover = _Handover(self, prefill, decode, req, first.token_ids[-1],
                             result.handoff_json)
        return Generation(r, prefill.worker_id, list(req.prompt_token_ids),
                          decision.predicted_hit_blocks * r.block_size, first,
                          _Migration(self, req, first, handover, decode_id),
                          decode_worker_id=decode_id)

    async def _aggregated(self, req: WorkerRequest, hashes: Sequence[int],
                          loads: list[WorkerLoad], reason: str | None) -> Generation:
        r = self.router
        decision = self._choose(hashes, loads, r.policy)
        if reason is not None:
            self._count_aggregated(reason)
        client = r.clients[decision.worker_id]
        stream = client.generate(req)
        try:
            first = await stream.__anext__()
        except InvalidRequestError as exc:
            await stream.aclose()
            raise BadRequestError(exc.message, param=exc.param) from None
        except WorkerUnavailableError as exc:
            await stream.aclose()
            r._healthy[decision.worker_id] = False
            raise NoHealthyWorkerError(str(exc)) from None
        except BaseException:
            await stream.aclose()
            raise
        self._count(req, decision, first, decision.worker_id)
        if req.params.n == 1:  # a continuation carries one sample
            stream = _Migration(self, req, first, stream, decision.worker_id)
        return Generation(r, decision.worker_id, list(req.prompt_token_ids),
                          decision.predicted_hit_blocks * r.block_size, first, stream,
                          decode_worker_id=decision.worker_id)

    def _count(self, req: WorkerRequest, decision: Decision, first: TokenEvent,
               decode_id: str) -> None:
        c = self.router.counters
        c.num_requests += 1
        c.num_prompt_tokens += len(req.prompt_token_ids)
        c.num_predicted_cached_tokens += decision.predicted_hit_blocks * self.router.block_size
        c.num_cached_tokens += first.num_cached_tokens
        c.first_tokens_by_worker[decision.worker_id] = (
            c.first_tokens_by_worker.get(decision.worker_id, 0) + 1)
        c.decodes_by_worker[decode_id] = c.decodes_by_worker.get(decode_id, 0) + 1


def _in_pool(loads: list[WorkerLoad], pool: list[str]) -> list[WorkerLoad]:
    members = set(pool)
    return [load for load in loads if load.worker_id in members]


async def _empty() -> AsyncIterator[TokenEvent]:
    return
    yield  # an async generator with no events


__all__ = ["DECODE_POOL", "Generation", "Orchestrator", "PREFILL_POOL"]
