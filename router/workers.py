"""The router's worker set: membership, health, live loads, descriptions, and the prefix index
fed from the workers' KV events. Torch-free.

Loads and KV events are pushed: each `WorkerClient` tells the set (`on_outputs`) what arrived on
its worker's output channel, with every engine step and on the channel's heartbeat, so routing
reads no stats per request. Requests routed to a worker since its last report count as waiting
there (`note_routed`), so a burst does not pile onto the worker that looked idlest a moment ago.
The orchestrator, the policies' inputs and the metrics read this set through its public methods.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from router.errors import WorkerUnavailableError
from router.policy import WorkerLoad
from router.prefix_index import PrefixIndex
from router.worker_client import WorkerClient
from workers.protocol import EngineStats, KVEvent, WorkerInfo, WorkerRole

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0


class WorkerSet:
    """The workers one router routes to. Event-loop thread only."""

    def __init__(self, clients: Sequence[WorkerClient]) -> None:
        ids = [c.worker_id for c in clients]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        self.clients: dict[str, WorkerClient] = {c.worker_id: c for c in clients}
        self.index = PrefixIndex()
        self.draining: set[str] = set()  # routed no new requests (being removed)
        self._infos: dict[str, WorkerInfo] = {}
        self._model: WorkerInfo | None = None  # the first worker's: the model as served
        self._healthy: dict[str, bool] = {wid: True for wid in self.clients}
        self._stats: dict[str, EngineStats] = {}
        self._routed: dict[str, int] = {}  # requests routed since the worker's last report
        self._resyncing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- membership --------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the workers' descriptions, seed the index, start listening to them."""
        infos = await asyncio.gather(*(c.info() for c in self.clients.values()))
        shapes = {(i.block_size, i.max_model_len, i.vocab_size) for i in infos}
        if len(shapes) != 1:
            raise ValueError(f"workers disagree on (block_size, max_model_len, vocab_size): "
                             f"{sorted(shapes)}; expected one model served one way")
        self._infos = {i.worker_id: i for i in infos}
        self._model = infos[0] if infos else None
        for client in self.clients.values():
            await self._seed(client)

    async def add(self, client: WorkerClient) -> None:
        """Start routing to a new worker. Raises `ValueError` when it serves the model
        differently from the others or its id is taken."""
        wid = client.worker_id
        if wid in self.clients:
            raise ValueError(f"worker {wid!r} is already routed to")
        info = await client.info()
        if self._model is not None:
            mine, theirs = self._shape(self._model), self._shape(info)
            if theirs != mine:
                raise ValueError(f"worker {wid!r} serves (block_size, max_model_len, "
                                 f"vocab_size)={theirs}; the others serve {mine}")
        self.clients[wid] = client
        self._infos[wid] = info
        self._model = self._model or info
        self._healthy[wid] = True
        await self._seed(client)

    async def remove(self, worker_id: str) -> None:
        """Stop routing to a worker that is gone; its streams fail over. Closes its client."""
        client = self.clients.pop(worker_id, None)
        if client is None:
            return
        for table in (self._infos, self._healthy, self._stats, self._routed):
            table.pop(worker_id, None)
        self.draining.discard(worker_id)
        self.index.remove_worker(worker_id)
        await client.close()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _seed(self, client: WorkerClient) -> None:
        """The worker's prefix cache and load as of now; then its pushed updates."""
        await self._resync(client.worker_id)
        try:
            self._stats[client.worker_id] = await client.stats()
        except WorkerUnavailableError:
            self.mark_unhealthy(client.worker_id)
        client.attach(self)

    @staticmethod
    def _shape(info: WorkerInfo) -> tuple[int, int, int]:
        return info.block_size, info.max_model_len, info.vocab_size

    # ---- what the orchestrator and metrics read ------------------------------------------------

    @property
    def any_info(self) -> WorkerInfo:
        """How the model is served (block size, context, vocabulary: the same on every
        worker), known from the first worker on, also while every worker is being replaced."""
        if self._model is None:
            raise RuntimeError("WorkerSet.start() has not run")
        return self._model

    @property
    def infos(self) -> dict[str, WorkerInfo]:
        return dict(self._infos)

    def info(self, worker_id: str) -> WorkerInfo:
        return self._infos[worker_id]

    def pool(self, *roles: WorkerRole) -> list[str]:
        """Ids of the workers serving one of `roles` (healthy or not)."""
        return [wid for wid, info in self._infos.items() if info.role in roles]

    def is_healthy(self, worker_id: str) -> bool:
        return self._healthy.get(worker_id, False)

    def healthy_workers(self) -> list[str]:
        return [wid for wid, ok in self._healthy.items() if ok and wid not in self.draining]

    def stats(self, worker_id: str) -> EngineStats | None:
        """The worker's load as it last reported it (None before its first report)."""
        return self._stats.get(worker_id)

    def loads(self, worker_ids: Sequence[str] | None = None) -> list[WorkerLoad]:
        """Each worker's load as last reported plus the requests routed to it since; draining
        and unreachable workers are marked unhealthy."""
        ids = list(self.clients) if worker_ids is None else worker_ids
        loads = []
        for wid in ids:
            s = self._stats.get(wid)
            healthy = self._healthy.get(wid, False) and wid not in self.draining
            routed = self._routed.get(wid, 0)
            if s is None:
                loads.append(WorkerLoad(wid, routed, 0, 0.0, healthy=healthy))
            else:
                loads.append(WorkerLoad(wid, s.num_waiting + s.num_waiting_for_kv + routed,
                                        s.num_running, min(1.0, max(0.0, s.kv_usage)),
                                        healthy=healthy,
                                        num_pending_prompt_tokens=s.num_pending_prompt_tokens))
        return loads

    def note_routed(self, worker_id: str) -> None:
        """A request was just sent to the worker (it counts as waiting until its report)."""
        self._routed[worker_id] = self._routed.get(worker_id, 0) + 1

    def mark_unhealthy(self, worker_id: str) -> None:
        if worker_id in self._healthy:
            self._healthy[worker_id] = False

    async def check_health(self) -> list[str]:
        """Ask every worker now; returns the healthy ones' ids."""
        async def ask(wid: str, client: WorkerClient) -> None:
            try:
                ok = await asyncio.wait_for(client.health(), HEALTH_TIMEOUT_S)
            except (WorkerUnavailableError, asyncio.TimeoutError):
                ok = False
            if wid in self._healthy:
                self._healthy[wid] = ok

        await asyncio.gather(*(ask(w, c) for w, c in list(self.clients.items())))
        return self.healthy_workers()

    # ---- what the clients push (`router.worker_client.WorkerListener`) ------------------------

    def on_outputs(self, worker_id: str, kv_events: Sequence[KVEvent],
                   stats: EngineStats) -> None:
        if worker_id not in self.clients:
            return
        self._stats[worker_id] = stats
        self._routed[worker_id] = 0
        # a worker whose engine reports a stalled step or a dead rank takes no new requests
        self._healthy[worker_id] = stats.healthy
        if kv_events:
            self.index.apply(worker_id, kv_events)
            if self.index.needs_resync(worker_id) and worker_id not in self._resyncing:
                self._spawn(self._resync(worker_id))

    def on_unreachable(self, worker_id: str, exc: WorkerUnavailableError) -> None:
        if worker_id in self.clients:
            logger.warning("worker %s is unreachable: %s", worker_id, exc)
            self.mark_unhealthy(worker_id)

    async def _resync(self, worker_id: str) -> None:
        client = self.clients.get(worker_id)
        if client is None:
            return
        self._resyncing.add(worker_id)
        try:
            snapshot = await client.kv_snapshot()
            if self.clients.get(worker_id) is client:  # else removed meanwhile: no ghost entry
                self.index.resync(worker_id, snapshot)
        except WorkerUnavailableError as exc:
            logger.warning("dropping worker %s from the prefix index: %s", worker_id, exc)
            self.mark_unhealthy(worker_id)
            self.index.remove_worker(worker_id)
        finally:
            self._resyncing.discard(worker_id)

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
