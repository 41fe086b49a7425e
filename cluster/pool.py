"""A worker pool's Serve replica: one worker group, its engine actor, its lifecycle.

Serve owns the replica (how many, where, restarts, health checks, scale-down); the replica owns
an `EngineActor` started in its placement group (with several ranks, the engine actor starts
each rank as a Ray actor in its own bundle), registers it in the `Directory`, reports the
pool's load signals for autoscaling, and drains before it goes: marked draining, routers send
it nothing new, move its running streams to the other workers with their KV and hand its
hottest prefixes to them (`router.hand_off`; Serve picks which replica goes, so the hand-off is
what keeps the pool's hits), what cannot move finishes (past `drain_timeout_s` it fails over
to another worker as a failed worker's would), then the engine stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import ray
from ray import serve
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.autoscaling import PLAN_SIGNAL
from cluster.config import POOL_ROLES, CleaveConfig, PoolSettings
from cluster.directory import HEARTBEAT_S, WorkerEntry
from cluster.engine_actor import ActorInfo, EngineActor, EngineSpec
from cluster.settings import (
    engine_config,
    model_path,
    pool_cores,
    torch_threads,
    worker_options,
)
from workers.models.model_config import ModelConfig
from workers.contract.protocol import EngineStats

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
DIRECTORY_TIMEOUT_S = 2.0


def engine_spec(config: CleaveConfig, pool: str, worker_id: str) -> EngineSpec:
    """What one replica of `pool` runs, from the deployment's config (`cluster.settings`)."""
    engine = engine_config(config, pool, model_path(config))
    worker = worker_options(config, pool)
    settings: PoolSettings = getattr(config.pools, pool)
    cores, per_rank = pool_cores(settings)
    return EngineSpec(worker_id, POOL_ROLES[pool], engine, worker,
                      torch_threads=torch_threads(settings), cpu_affinity=cores,
                      cores_per_rank=per_rank)


def engine_actor_options(settings: PoolSettings, pg: PlacementGroup | None) -> dict[str, Any]:
    """Ray options of a replica's engine actor, in bundle 0 of the replica's placement group
    `pg`. A one-rank engine holds the bundle's CPUs and GPUs; an engine of more ranks only
    drives them and holds nothing: each rank actor holds its own bundle."""
    drives_only = settings.ranks > 1 and pg is not None
    options: dict[str, Any] = {"num_cpus": 0 if drives_only else settings.cpus_per_rank,
                               "num_gpus": 0 if drives_only else settings.gpus_per_rank,
                               "max_concurrency": 10_000}
    if pg is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0)
    return options


class WorkerReplica:
    """The Serve deployment class of every pool (bound once per pool, named `pool-<name>`)."""

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
            self, config: dict[str, Any], pool: str, directory: Any) -> None:
        self.config = CleaveConfig.parse(config)
        self.pool = pool
        self.settings = getattr(self.config.pools, pool)
        self.directory = directory
        replica = serve.get_replica_context().replica_id.unique_id
        self.worker_id = f"{pool}-{replica}"
        spec = engine_spec(self.config, pool, self.worker_id)
        self.config.check_against_model(ModelConfig.from_pretrained(spec.engine.model))
        pg = ray.util.get_current_placement_group()  # more than one rank: theirs too
        self.actor = ray.remote(EngineActor).options(
            **engine_actor_options(self.settings, pg)).remote(spec, pg)
        info: ActorInfo = await self.actor.ready.remote()  # the model is loaded
        self.entry = WorkerEntry(self.worker_id, pool, POOL_ROLES[pool], self.actor,
                                 info.node_id)
        await self.directory.register.remote(self.entry)
        self._draining = False
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        logger.info("worker %s (%s) ready on node %s", self.worker_id, pool, info.node_id)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self.directory.register.remote(self.entry)
            # the directory restarting: the next beat re-registers
            except Exception as exc:  # noqa: BLE001 -- (see above)
                logger.warning("worker %s: heartbeat failed: %s", self.worker_id, exc)

    async def check_health(self) -> None:
        """Serve restarts the replica when this raises: a dead or broken engine."""
        healthy = await asyncio.wait_for(self.actor.health.remote(), HEALTH_TIMEOUT_S)
        if not healthy:
            raise RuntimeError(f"worker {self.worker_id}: the engine is not healthy")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load, and (with SLO targets set) the SLO plan's replica count for
        its pool while the directory holds a fresh plan, read by
        `cluster.autoscaling.PoolPolicy`."""
        s: EngineStats = await asyncio.wait_for(self.actor.stats.remote(), HEALTH_TIMEOUT_S)
        stats = {"pending_prompt_tokens": float(s.num_pending_prompt_tokens),
                 "kv_usage": s.kv_usage, "running_seqs": float(s.num_running + s.num_waiting)}
        router = self.config.router
        if router.slo_ttft_ms is None or router.slo_itl_ms is None:
            return stats  # no SLO targets: no planner, the load rule applies
        try:
            plan = await asyncio.wait_for(self.directory.plan.remote(), DIRECTORY_TIMEOUT_S)
        except Exception:  # noqa: BLE001 -- no directory: no plan, the load rule applies
            plan = None
        wanted = None if plan is None else plan.replicas_for(POOL_ROLES[self.pool])
        if wanted is not None:
            stats[PLAN_SIGNAL] = float(wanted)
        return stats

    async def describe(self) -> dict[str, Any]:
        """The replica's worker id, pool, node and load (`cleave status`)."""
        return {"worker_id": self.worker_id, "pool": self.pool, "node_id": self.entry.node_id,
                "draining": self._draining,
                **dataclasses.asdict(await asyncio.wait_for(self.actor.stats.remote(),
                                                            HEALTH_TIMEOUT_S))}

    async def __del__(self) -> None:
        """Serve is removing this replica (scale-down, redeploy, shutdown): drain, then stop."""
        self._draining = True
        self._heartbeat.cancel()
        a = self.settings.autoscaling
        try:
            # bounded: when the whole app goes, the directory may already be gone
            await asyncio.wait_for(self.directory.set_draining.remote(self.worker_id),
                                   DIRECTORY_TIMEOUT_S)
            # routers read the directory every kv_poll_interval_s: let them all see it and
            # start moving its streams and its hot prefixes (an idle worker with a cold cache
            # need not wait: a request routed meanwhile starts on another)
            stats = await asyncio.wait_for(self.actor.stats.remote(), HEALTH_TIMEOUT_S)
            busy = stats.num_running + stats.num_waiting + stats.num_waiting_for_kv
            if busy or stats.recent_hit_blocks >= 1.0:
                await asyncio.sleep(2 * self.config.router.kv_poll_interval_s + 0.5)
            left = await self.actor.wait_idle.remote(a.drain_timeout_s)
            if left:
                logger.warning("worker %s: %d requests still running after %.0fs of draining; "
                               "they move to other workers", self.worker_id, left,
                               a.drain_timeout_s)
            await self.actor.shutdown.remote()
        except Exception as exc:  # noqa: BLE001 -- going away regardless
            logger.warning("worker %s: draining failed: %s", self.worker_id, exc)
        finally:
            try:
                await asyncio.wait_for(self.directory.deregister.remote(self.worker_id),
                                       DIRECTORY_TIMEOUT_S)
            except Exception:  # noqa: BLE001 -- the directory may be going away too
                pass
            ray.kill(self.actor)
