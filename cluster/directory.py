"""Which workers exist right now: the Serve deployment every pool replica registers with and
every router replica reads.

A pool replica registers its engine actor's handle when its model is loaded and re-registers on
a heartbeat, so a restarted directory fills again within one period; entries not refreshed for
`ttl_s` expire (a replica killed without a goodbye). A replica being removed marks itself
draining first: routers stop sending it new requests, it finishes (or fails over) what it holds,
then it deregisters.

It also hosts the router replicas' `PlanBoard` (`router.plan_share`): the SLO planner's lease,
the replicas' traffic and the leader's plan, which the pool replicas read for autoscaling
(`cluster.pool`). Soft too: a restarted directory has no lease and no plan until the next
tick (the pools' load rule applies meanwhile).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from router.plan_share import BoardView, PlanBoard, SharedPlan
from router.planner import RequestClass

HEARTBEAT_S = 1.0
TTL_S = 10.0


@dataclass(frozen=True)
class WorkerEntry:
    worker_id: str
    pool: str  # "prefill", "decode" or "aggregated"
    role: str  # the worker role: "prefill", "decode" or "both"
    actor: Any  # the engine actor's handle (`cluster.engine_actor.EngineActor`)
    node_id: str
    draining: bool = False
    # how routers move its running streams: with their KV (live, then its hot prefixes follow),
    # or by recomputing them on the other workers with nothing handed off (replay: the
    # baseline `benchmarks/drain_ray.py` measures against)
    drain_with_kv: bool = True
    seen: float = 0.0  # time.monotonic() of the last heartbeat, set by the directory
    # the role routers route it under when an operator switched it (`cleave role`: "prefill",
    # "decode" or "both"); None: its own. Only a worker started as "both" is switched.
    assigned_role: str | None = None


class Directory:
    """The registry. One replica; state is soft (rebuilt from heartbeats)."""

    def __init__(self, ttl_s: float = TTL_S) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, WorkerEntry] = {}
        self._board = PlanBoard()

    def register(self, entry: WorkerEntry) -> None:
        """Add or refresh a worker. A draining worker stays draining, a switched one keeps
        its assigned role."""
        old = self._entries.get(entry.worker_id)
        if old is not None and old.draining:
            entry = replace(entry, draining=True, drain_with_kv=old.drain_with_kv)
        if old is not None:
            entry = replace(entry, assigned_role=old.assigned_role)
        self._entries[entry.worker_id] = replace(entry, seen=time.monotonic())

    def set_draining(self, worker_id: str, with_kv: bool = True) -> None:
        entry = self._entries.get(worker_id)
        if entry is not None:
            self._entries[worker_id] = replace(entry, draining=True, drain_with_kv=with_kv)

    def undrain(self, worker_id: str) -> None:
        """Put a drained worker that was not removed (`cleave drain` without the restart)
        back in rotation: routers send it requests again."""
        entry = self._entries.get(worker_id)
        if entry is not None:
            self._entries[worker_id] = replace(entry, draining=False, drain_with_kv=True)

    def assign_role(self, worker_id: str, role: str) -> None:
        """Route the worker under `role` in every router replica (`cleave role`: the replica
        that switched it already does; the others follow at their next sync)."""
        entry = self._entries.get(worker_id)
        if entry is not None:
            self._entries[worker_id] = replace(entry, assigned_role=role)

    def deregister(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)

    def entries(self) -> list[WorkerEntry]:
        """The live workers (expired ones dropped), sorted by id."""
        now = time.monotonic()
        for wid in [w for w, e in self._entries.items() if now - e.seen > self.ttl_s]:
            del self._entries[wid]
        return sorted(self._entries.values(), key=lambda e: e.worker_id)

    def plan_tick(self, replica: str, traffic: tuple[RequestClass, ...]) -> BoardView:
        """A router replica's planner tick (`PlanBoard.tick`)."""
        return self._board.tick(replica, traffic, time.monotonic())

    def publish_plan(self, plan: SharedPlan) -> bool:
        """The leader's plan (`PlanBoard.publish`); False: not the lease's holder."""
        return self._board.publish(plan, time.monotonic())

    def plan(self) -> SharedPlan | None:
        """The leader's plan while fresh (what the pools' autoscaling follows)."""
        return self._board.latest(time.monotonic())

    def check_health(self) -> None:
        """Serve's health check: a directory that answers is healthy."""
