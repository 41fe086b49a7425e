"""Keeping a started request going when its worker or its KV pull fails: `Failover`, the
`router.streams.Recovery` every generation is built with (`router.generations`). Torch-free.

A stream whose worker fails mid-way resumes on another healthy decode-pool worker the routing
policy picks (the prompt plus every token already sent), waiting up to
`RouterConfig.migration_wait_s` for one; a failed KV pull is counted (the decode worker then
computes the prompt itself: `router.streams.Generation`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from router.config import RouterConfig
from router.counters import RouterCounters
from router.errors import WorkerUnavailableError
from router.metrics import RouterMetrics
from router.policy import NoHealthyWorker, RoutingPolicy
from router.worker_client import TokenStream, WorkerClient
from router.workers import WorkerSet
from workers.contract.messages import ResumedSample
from workers.contract.prefix_cache import adapter_salt, hash_prompt_blocks
from workers.contract.protocol import KVPullFailed, WorkerRequest, WorkerRole
from workers.contract.tracing import tracing

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff

DECODE_POOL = (WorkerRole.DECODE, WorkerRole.BOTH)
MIGRATION_POLL_S = 0.25  # how often a stream waiting to migrate looks for a worker again


class Failover:
    """Implements `router.streams.Recovery` over a `WorkerSet`."""

    def __init__(self, workers: WorkerSet, policy: RoutingPolicy, counters: RouterCounters,
                 metrics: RouterMetrics, config: RouterConfig) -> None:
        """`policy`: picks the worker a failed stream resumes on (it recomputes the prompt,
        so the routing policy: prefix-aware by default)."""
        self.workers = workers
        self.policy = policy
        self.counters = counters
        self.metrics = metrics
        self.config = config

    async def migrate(self, req: WorkerRequest, samples: list[ResumedSample], tried: list[str],
                      exc: Exception) -> tuple[str, TokenStream]:
        """Resume the samples on another healthy decode-pool worker, waiting up to
        `migration_wait_s` for one (a cluster's pool replaces its lost replicas); raise `exc`
        when none comes."""
        with tracing().span("router.migration", attributes={
                "from_worker": tried[-1] if tried else "", "reason": type(exc).__name__,
                "samples": len(samples)}) as span:
            worker_id, stream = await self._resume_elsewhere(req, samples, tried, exc)
            if span is not None:
                span.set_attributes({"to_worker": worker_id})
        return worker_id, stream

    async def _resume_elsewhere(self, req: WorkerRequest, samples: list[ResumedSample],
                                tried: list[str], exc: Exception) -> tuple[str, TokenStream]:
        w = self.workers
        if isinstance(exc, WorkerUnavailableError) and tried:
            w.mark_unhealthy(tried[-1])
        hashes = hash_prompt_blocks(req.prompt_token_ids, w.any_info.block_size,
                                    adapter_salt(req.cache_salt, req.lora_name))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.migration_wait_s
        while True:
            loads = w.pool_loads(*DECODE_POOL).without(tried)
            try:
                decision = self.policy.choose(hashes, loads, w.index, req.lora_name)
                break
            except NoHealthyWorker:
                if loop.time() >= deadline:
                    raise exc from None
                await asyncio.sleep(MIGRATION_POLL_S)
        self.counters.count_fallback("decode_worker_failed")
        self.counters.count_decode(decision.worker_id)
        w.note_routed(decision.worker_id, req.lora_name)
        client: WorkerClient = w.clients[decision.worker_id]
        return decision.worker_id, client.resume(req, samples)

    def kv_pulled(self, decode_id: str, handoff: KVHandoff, seconds: float) -> None:
        self.metrics.kv_transferred(decode_id, handoff, seconds)

    def kv_pull_failed(self, decode_id: str, exc: KVPullFailed) -> None:
        self.counters.count_fallback("kv_pull_failed")
        self.metrics.kv_transfer_failed(decode_id, exc.kind)


__all__ = ["DECODE_POOL", "Failover"]
