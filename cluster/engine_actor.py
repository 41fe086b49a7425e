"""One worker's engine as a Ray actor: the child actor a pool replica starts and the routers call.

The pool's Serve replica (`cluster.deployments.WorkerReplica`) owns this actor and its
lifetime; routers hold its handle (from the directory) and call it directly, so a request goes
router -> engine with no hop through Serve. Every method is async and runs on the actor's one
event loop, where the engine's `AsyncEngine` also steps.

KV events are kept in a bounded log read by every router replica with its own cursor
(`kv_events(subscriber)`): each router sees every event once. A router that falls further
behind than the log sees a sequence gap, and its prefix index resyncs from `kv_snapshot()`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
from typing import Any, AsyncIterator

import ray
from ray.util.placement_group import PlacementGroup

from workers.protocol import EngineStats, KVEvent, KVSnapshot, PrefillResult, SamplingParams, TokenEvent

logger = logging.getLogger(__name__)

KV_EVENT_LOG_SIZE = 65536  # events kept for routers that have not read them yet


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the actor builds: one `workers.worker.Worker`."""

    worker_id: str
    role: str  # "prefill", "decode" or "both"
    engine: dict[str, Any]  # `workers.config.EngineConfig` fields, model included
    transport: str = "tcp"
    lease_s: float = 30.0
    pull_timeout_s: float = 10.0
    torch_threads: int | None = None  # None: torch's default


class _EventLog:
    """KV events with absolute positions; each subscriber reads from its own cursor."""

    def __init__(self, size: int = KV_EVENT_LOG_SIZE) -> None:
        self._events: collections.deque[KVEvent] = collections.deque(maxlen=size)
        self._end = 0  # absolute position after the newest event
        self._cursors: dict[str, int] = {}

    def extend(self, events: list[KVEvent]) -> None:
        self._events.extend(events)
        self._end += len(events)

    def read(self, subscriber: str) -> list[KVEvent]:
        """Events since this subscriber's last read (a new one starts at the oldest kept)."""
        start = self._end - len(self._events)
        cursor = max(self._cursors.get(subscriber, start), start)
        self._cursors[subscriber] = self._end
        return list(self._events)[cursor - start:]


class EngineActor:
    """A `Worker` behind Ray. Build with
    `ray.remote(EngineActor).options(...).remote(spec, placement_group)`; `ready()` returns once
    the model is loaded."""

    def __init__(self, spec: EngineSpec, placement_group: PlacementGroup | None = None) -> None:
        """`placement_group`: the replica's, one bundle per rank, on this actor's node. An
        engine of more than one rank starts rank i as a Ray actor in bundle i, holding the
        bundle's resources (`cluster.rank_actor`); None: its ranks are spawned processes."""
        if spec.torch_threads:
            import torch

            torch.set_num_threads(spec.torch_threads)
        from cluster.rank_actor import RayActorLauncher
        from workers.config import EngineConfig
        from workers.worker import Worker

        self.spec = spec
        config = EngineConfig(**spec.engine)
        self.rank_launcher = (RayActorLauncher(placement_group)
                              if placement_group is not None and config.world_size > 1
                              else None)
        host = ray.util.get_node_ip_address()
        self.worker = Worker.from_config(spec.worker_id, config, spec.role,
                                         rank_launcher=self.rank_launcher,
                                         transport=spec.transport, host=host,
                                         lease_s=spec.lease_s,
                                         pull_timeout_s=spec.pull_timeout_s)
        self.log = _EventLog()
        self.in_flight: set[str] = set()
        self._broken: str | None = None

    async def ready(self) -> dict[str, Any]:
        """The worker's description (`router.worker_client.WorkerInfo` fields), once its
        transfer agents passed the transport's self-check (workers that hand KV off), and
        `ranks`: where each rank actor runs (`cluster.rank_actor.RankPlace` fields; empty when
        the ranks are in this process or spawned)."""
        w = self.worker
        if w.role != "both":
            await w.agents()
        ranks = self.rank_launcher.ranks if self.rank_launcher is not None else []
        places = [dataclasses.asdict(await r.actor.place.remote()) for r in ranks]
        return {"worker_id": w.worker_id, "role": w.role, "block_size": w.block_size,
                "max_model_len": w.max_model_len, "vocab_size": w.vocab_size,
                "num_blocks": w.num_blocks, "tp_size": w.tp_size, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(), "ranks": places}

    # ---- requests ------------------------------------------------------------------------

    async def _tracked(self, request_id: str,
                       stream: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        self.in_flight.add(request_id)
        try:
            async for event in stream:
                yield event
        finally:
            self.in_flight.discard(request_id)
            await stream.aclose()  # type: ignore[attr-defined]

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       cache_salt: str | None) -> AsyncIterator[TokenEvent]:
        async for event in self._tracked(request_id, self.worker.generate(
                request_id, prompt, params, cache_salt)):
            yield event

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                      cache_salt: str | None, kv_readers: int = 1) -> PrefillResult:
        self.in_flight.add(request_id)
        try:
            return await self.worker.prefill(request_id, prompt, params, cache_salt,
                                             kv_readers)
        finally:
            self.in_flight.discard(request_id)

    async def decode(self, request_id: str, prompt: list[int], first_token_id: int,
                     params: SamplingParams,
                     handoff_json: str | None) -> AsyncIterator[TokenEvent]:
        async for event in self._tracked(request_id, self.worker.decode(
                request_id, prompt, first_token_id, params, handoff_json)):
            yield event

    async def resume(self, request_id: str, prompt: list[int], sent_token_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[TokenEvent]:
        async for event in self._tracked(request_id, self.worker.resume(
                request_id, prompt, sent_token_ids, params)):
            yield event

    async def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    # ---- load, events, health --------------------------------------------------------------

    async def stats(self) -> EngineStats:
        return self.worker.stats()

    async def kv_events(self, subscriber: str) -> list[KVEvent]:
        self.log.extend(await self.worker.drain_kv_events())
        return self.log.read(subscriber)

    async def kv_snapshot(self) -> KVSnapshot:
        return await self.worker.kv_snapshot()

    async def health(self) -> bool:
        """False once the engine loop has died or the actor was marked broken."""
        if self._broken is not None:
            return False
        return self.worker.async_engine.is_healthy

    async def mark_broken(self, reason: str) -> None:
        """Fail health checks from now on (tests: a broken engine)."""
        self._broken = reason

    async def num_in_flight(self) -> int:
        return len(self.in_flight)

    async def wait_idle(self, timeout_s: float) -> int:
        """Wait until no request is in flight or `timeout_s` passes; returns those left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return len(self.in_flight)

    async def shutdown(self) -> None:
        await self.worker.shutdown()
