"""The router's worker set: membership, health, live loads, descriptions, and the prefix index
fed from the workers' KV events. Torch-free.

Loads and KV events are pushed: each `WorkerClient` tells the set (`on_outputs`) what arrived on
its worker's output channel, with every engine step and on the channel's heartbeat, so routing
reads no stats per request. Requests routed to a worker since its last report count as waiting
there (`note_routed`), so a burst does not pile onto the worker that looked idlest a moment ago;
the LoRA adapters in each worker's slots come with its reports (`router.residency`). The loads
live in one `router.loads.LoadTable`, a row per worker updated in place by each report; a pool's
loads are that table with the pool's rows as candidates (no cost per worker). Rows are never
reused: a table read before a worker left still names it (`LoadTable.without` drops it). The
orchestrator, the policies' inputs and the metrics read this set through its public methods."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence

import numpy as np

from router.errors import WorkerUnavailableError
from router.loads import LoadTable
from router.prefix_index import PrefixIndex
from router.worker_client import WorkerClient
from workers.contract.protocol import EngineStats, WorkerInfo, WorkerRole
from workers.contract.prefix_cache import KVEvent

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
# a prefix pull before the worker has measured any pull: half a recompute (its prefill rate
# is measured; the pull's is learned from the first ones)
FETCH_COST_PRIOR = 0.5


def fetch_cost(info: WorkerInfo | None, stats: EngineStats) -> float | None:
    """Pulling one KV block into the worker as a fraction of recomputing it there: the block's
    bytes at its measured pull rate over a block of prompt tokens at its measured prefill rate.
    None (it fetches nothing) until its prefill rate is measured."""
    if info is None or not info.kv_bytes_per_block or not stats.prefill_s_per_token:
        return None
    if not stats.kv_pull_bytes_per_s:
        return FETCH_COST_PRIOR
    recompute_s = stats.prefill_s_per_token * info.block_size
    return info.kv_bytes_per_block / stats.kv_pull_bytes_per_s / recompute_s


def fetch_fixed_blocks(info: WorkerInfo | None, stats: EngineStats) -> float:
    """What one prefix fetch into the worker costs whatever its size (its measured
    `kv_fetch_fixed_s`), in blocks of prompt recomputed at its measured prefill rate; 0.0 until
    both are measured."""
    if info is None or not stats.prefill_s_per_token:
        return 0.0
    return stats.kv_fetch_fixed_s / (stats.prefill_s_per_token * info.block_size)


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
        self._assigned: dict[str, WorkerRole] = {}  # a "both" worker's role as routed
        self._model: WorkerInfo | None = None  # the first worker's: the model as served
        self._stats: dict[str, EngineStats] = {}
        self._table = LoadTable.empty()
        self._pools: dict[tuple[WorkerRole, ...], np.ndarray] = {}  # roles -> rows, ascending
        for wid in self.clients:
            self._table.add(wid)
        self._resyncing: set[str] = set()
        self.observers: list[Callable[[str, EngineStats], None]] = []  # told each load
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
        self._table.add(wid)
        self._pools.clear()
        await self._seed(client)

    async def remove(self, worker_id: str) -> None:
        """Stop routing to a worker that is gone; its streams fail over. Closes its client."""
        client = self.clients.pop(worker_id, None)
        if client is None:
            return
        for table in (self._infos, self._stats, self._assigned):
            table.pop(worker_id, None)
        self._table.remove(worker_id)
        self._pools.clear()
        self.draining.discard(worker_id)
        self.index.remove_worker(worker_id)
        await client.close()

    async def stop(self) -> None:
        """Stop; forget the workers (their clients, closed as the server stops, are no news)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.clients.clear()

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

    def fetch_saving_s(self, worker_id: str, num_blocks: int) -> float:
        """The prefill seconds a pull of `num_blocks` into `worker_id` is predicted to save
        (its recompute at the measured prefill rate, less the pull at the measured cost)."""
        stats, info = self._stats.get(worker_id), self._infos.get(worker_id)
        if stats is None or info is None:
            return 0.0
        cost = fetch_cost(info, stats)
        recompute_s = num_blocks * info.block_size * stats.prefill_s_per_token
        if cost is None:
            return 0.0
        return recompute_s * (1.0 - cost) - stats.kv_fetch_fixed_s

    def pool(self, *roles: WorkerRole) -> list[str]:
        """Ids of the workers routed under one of `roles` (healthy or not)."""
        return [wid for wid in self._infos if self.role_of(wid) in roles]

    def role_of(self, worker_id: str) -> WorkerRole:
        """The role the worker is routed under: its own or the one assigned."""
        return self._assigned.get(worker_id) or self._infos[worker_id].role

    def assign_role(self, worker_id: str, role: WorkerRole) -> None:
        """Route a worker started as BOTH under `role` from now on (`Router.switch_role`
        first moves its streams away); `ValueError` for a worker started for one half."""
        own = self._infos[worker_id].role
        if own != WorkerRole.BOTH and role != own:
            raise ValueError(f"worker {worker_id!r} was started as {own.value!r}; only a "
                             f"worker started as 'both' switches role, not to {role.value!r}")
        self._assigned[worker_id] = role
        self._pools.clear()

    def is_healthy(self, worker_id: str) -> bool:
        row = self._table.row_of.get(worker_id)
        return row is not None and bool(self._table.healthy[row])

    def healthy_workers(self) -> list[str]:
        return [wid for wid in self.clients if self.is_healthy(wid) and wid not in self.draining]

    def stats(self, worker_id: str) -> EngineStats | None:
        """The worker's load as it last reported it (None before its first report)."""
        return self._stats.get(worker_id)

    def loads(self, worker_ids: Sequence[str] | None = None) -> LoadTable:
        """The loads of `worker_ids` (default: every worker) as last reported plus the
        requests routed to them since; draining and unreachable workers are unhealthy."""
        ids = list(self.clients) if worker_ids is None else worker_ids
        return self._readable(self._table.select(self._table.rows_of(ids)))

    def pool_loads(self, *roles: WorkerRole) -> LoadTable:
        """`loads(pool(*roles))` without a step per worker: the pool's rows are kept until
        the membership changes."""
        rows = self._pools.get(roles)
        if rows is None:
            rows = self._pools[roles] = self._table.rows_of(self.pool(*roles))
        return self._readable(self._table.select(rows))

    def _readable(self, table: LoadTable) -> LoadTable:
        """`table` with the draining workers unhealthy (their rows stay healthy in the set's
        own table: draining is the cluster's word, health the worker's)."""
        if not self.draining:
            return table
        healthy = table.healthy.copy()
        for wid in self.draining:
            if wid in table.row_of:
                healthy[table.row_of[wid]] = False
        return table.with_healthy(healthy)

    def note_routed(self, worker_id: str, lora_name: str | None = None) -> None:
        """A request was just sent to the worker (it counts as waiting, and its adapter as
        held there, until the worker's next report)."""
        self._table.note_routed(worker_id, lora_name)

    def mark_unhealthy(self, worker_id: str) -> None:
        self._set_healthy(worker_id, False)

    def _set_healthy(self, worker_id: str, healthy: bool) -> None:
        row = self._table.row_of.get(worker_id)
        if row is not None:
            self._table.healthy[row] = healthy

    async def check_health(self) -> list[str]:
        """Ask every worker now; returns the healthy ones' ids."""
        async def ask(wid: str, client: WorkerClient) -> None:
            try:
                ok = await asyncio.wait_for(client.health(), HEALTH_TIMEOUT_S)
            except (TimeoutError, WorkerUnavailableError):
                ok = False
            self._set_healthy(wid, ok)

        await asyncio.gather(*(ask(w, c) for w, c in list(self.clients.items())))
        return self.healthy_workers()

    # ---- what the clients push (`router.worker_client.WorkerListener`) ------------------------

    def on_outputs(self, worker_id: str, kv_events: Sequence[KVEvent],
                   stats: EngineStats) -> None:
        if worker_id not in self.clients:
            return
        self._stats[worker_id] = stats
        # requests routed there since the last report are in this one; a worker whose engine
        # reports a stalled step or a dead rank takes no new requests
        info = self._infos.get(worker_id)
        self._table.report(worker_id, stats.num_waiting + stats.num_waiting_for_kv,
                           stats.num_running, stats.kv_usage, stats.num_pending_prompt_tokens,
                           stats.healthy, fetch_cost(info, stats), stats.host_hit_cost,
                           fetch_fixed_blocks(info, stats), stats.prefill_s_per_token,
                           stats.lora_adapters, stats.num_due_prompt_tokens)
        for observe in self.observers:
            observe(worker_id, stats)
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

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
