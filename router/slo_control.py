"""The SLO planner's loop in a router replica, on when `RouterConfig.slo_ttft_ms` and
`slo_itl_ms` are set. Torch-free.

It records every request's prompt and output length as it arrives (`arrived`) and every
worker's pushed load (`observe`, one report per engine step): a report that follows a pure
decode step is that step's cost at its batch, fitted into a `StepProfile` with the measured
prefill rate (`router.profiles.ProfileFitter`). Each `tick` (every `TICK_S`) plans
(`router.planner.SloPlanner`) within the workers the router has, then applies what a router
can: the split policy's threshold (when the policy is `uncached_threshold`) and the role
switches of the workers started as "both" (`router.role_plan`, `router.role_switch`), one at
a time. Each new plan (a decision) is logged with its kind and reason, counted by kind and
exported (`router.plan_metrics`), and published as a `SharedPlan`.

With several router replicas one decides (`router.plan_share`: the holder of the board's
lease, on the cluster's `Directory`); it plans for every replica's traffic and publishes its
plan, with the replica counts the pools' autoscaling reads (`cluster.autoscaling`). The others
follow it: its threshold, and its role assignments (each moves its own streams off a worker
switching to prefill). A lone router decides on a `LocalBoard`, within the workers it has.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from router.config import RouterConfig
from router.live_migration import LiveMigrations
from router.plan_metrics import PlanCollector
from router.plan_share import BoardView, PlanBoard, SharedPlan, decision_kind, threshold_words
from router.planner import Plan, PlanInput, PoolBounds, RequestClass, SloPlanner, SloTargets
from router.profiles import ProfileFitter
from router.role_plan import RoleChanges, WorkerState, role_changes
from router.role_switch import switch_role
from router.split_policy import SplitPolicy, UncachedThreshold
from router.traffic import TrafficWindow
from router.workers import WorkerSet
from workers.contract.protocol import EngineStats, WorkerRole

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

TICK_S = 1.0
MAX_STEP_S = 10.0  # a longer interval between two reports is idleness, not a step
# the traffic window the planner reads: a class the mix moved away from is planned for this
# long after its last arrival (a role switch back waits for it)
WINDOW_S = 15.0


class Splits(Protocol):
    """What holds the router's "hand off or run here" policy (the orchestrator)."""

    split: SplitPolicy


class Board(Protocol):
    """Where the router replicas' planners meet (`router.plan_share.PlanBoard`, hosted)."""

    async def tick(self, replica: str, traffic: tuple[RequestClass, ...]) -> BoardView: ...

    async def publish(self, plan: SharedPlan) -> bool: ...


class LocalBoard:
    """A `PlanBoard` in this process: a lone router (or tests sharing one between planners)."""

    def __init__(self, board: PlanBoard | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.board = board or PlanBoard()
        self.clock = clock

    async def tick(self, replica: str, traffic: tuple[RequestClass, ...]) -> BoardView:
        return self.board.tick(replica, traffic, self.clock())

    async def publish(self, plan: SharedPlan) -> bool:
        return self.board.publish(plan, self.clock())


class SloControl:
    """The planner's inputs, its plan, and what the router applies of it. Event-loop thread."""

    def __init__(self, config: RouterConfig, workers: WorkerSet, migrations: LiveMigrations,
                 registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`registry`: where the planner's metrics are exported (`router.plan_metrics`);
        `clock`: the time arrivals and pushed steps are stamped with."""
        if config.slo_ttft_ms is None or config.slo_itl_ms is None:
            raise ValueError(f"the SLO planner needs slo_ttft_ms and slo_itl_ms, got "
                             f"{config.slo_ttft_ms} and {config.slo_itl_ms}")
        self.targets = SloTargets(config.slo_ttft_ms / 1000, config.slo_itl_ms / 1000,
                                  config.slo_percentile)
        self.workers, self.migrations = workers, migrations
        self.clock = clock
        self.traffic = TrafficWindow(window_s=WINDOW_S)
        self.fitter = ProfileFitter()
        self.planner = SloPlanner()
        self.plan: Plan | None = None
        self.changes: RoleChanges | None = None
        self._last: dict[str, tuple[float, bool]] = {}  # worker -> (report time, pure decode)
        self.board: Board = LocalBoard()
        self.replica = "router"  # this replica's name on the board
        self.bounds: PoolBounds | None = None  # None: within the workers the router has
        self.leader = False
        self.shared: SharedPlan | None = None  # the plan acted on: this replica's or the leader's
        self.decisions: dict[str, int] = {}  # decisions by kind (`decision_kind`)
        # why there is no plan to act on (None: there is one), as status and metrics show it
        self.waiting: str | None = "no planning tick yet"
        if registry is not None:
            registry.register(PlanCollector(self))

    def share(self, board: Board, replica: str, bounds: PoolBounds) -> None:
        """Decide with the other router replicas on `board` (as `replica`), for pools bounded
        by `bounds` (the plan's workers become replica counts, not only role switches)."""
        self.board, self.replica, self.bounds = board, replica, bounds

    def arrived(self, prompt_tokens: int, output_tokens: int) -> None:
        self.traffic.arrived(self.clock(), prompt_tokens, output_tokens)

    def observe(self, worker_id: str, stats: EngineStats) -> None:
        """A worker's pushed load (`WorkerSet.observers`)."""
        now = self.clock()
        pure = (stats.num_running > 0 and stats.num_waiting == 0
                and stats.num_pending_prompt_tokens == 0)
        last = self._last.get(worker_id)
        if last is not None and last[1] and pure and now - last[0] < MAX_STEP_S:
            self.fitter.observe_decode(stats.num_running, 0.0, now - last[0])
        self._last[worker_id] = (now, pure)
        self.fitter.observe_prefill_rate(stats.prefill_s_per_token)

    def decide(self, classes: tuple[RequestClass, ...] | None = None) -> Plan | None:
        """This tick's plan for `classes` (default: this replica's traffic), or None while
        there is no traffic or no profile yet (`waiting` says which). A plan that changes the
        workers or the threshold is a decision: logged with its reason and counted by kind."""
        if classes is None:
            classes = self.traffic.classes(self.clock())
        profile = self.fitter.profile()
        if not classes or profile is None:
            self._wait(f"no requests in the last {WINDOW_S:g} s" if not classes else
                       "no step profile yet (a worker's pushed decode steps at two batch "
                       "sizes and its prefill rate)")
            return None
        table = self.workers.loads()
        backlog = float(table.pending[table.rows].sum())
        bounds = self.bounds or PoolBounds(max_workers=max(1, len(self.workers.clients)))
        plan = self.planner.decide(PlanInput(classes, profile, self.targets, bounds, backlog))
        kind = decision_kind(self.plan, plan)
        if kind is not None:
            self.decisions[kind] = self.decisions.get(kind, 0) + 1
            logger.info("SLO plan (%s, router %s): %d prefill, %d decode, threshold %s%s; why: %s",
                        kind, self.replica, plan.prefill, plan.decode,
                        threshold_words(plan.threshold_tokens),
                        "" if plan.feasible else " (targets out of reach within the bounds)",
                        plan.reason)
        self.plan, self.waiting = plan, None
        return plan

    def _wait(self, why: str) -> None:
        """No plan to act on, because `why` (logged when it changes)."""
        if why != self.waiting:
            logger.info("SLO planner (router %s) has no plan: %s", self.replica, why)
        self.waiting = why

    def split_policy(self, current: SplitPolicy) -> SplitPolicy:
        """`current`, with the plan's threshold (this replica's, or the leader's it follows)
        when it is the threshold policy."""
        plan = self.plan or self.shared
        if plan is None or not isinstance(current, UncachedThreshold) or \
                current.threshold_tokens == plan.threshold_tokens:
            return current
        return UncachedThreshold(plan.threshold_tokens)

    async def apply(self) -> list[str]:
        """Switch the roles the plan asks for; the workers switched."""
        if self.plan is None:
            return []
        w = self.workers
        states = [WorkerState(wid, w.role_of(wid), self._switchable(wid),
                              len(self.migrations.on(wid)))
                  for wid in w.healthy_workers()]
        self.changes = role_changes(states, self.plan)
        return await self._switch(self.changes.switches)

    async def follow(self, plan: SharedPlan) -> list[str]:
        """Route the switchable workers as the leader does (`plan.prefill_workers`); the
        workers switched."""
        want = set(plan.prefill_workers)
        switches = []
        for wid in self.workers.healthy_workers():
            role = WorkerRole.PREFILL if wid in want else WorkerRole.BOTH
            if self._switchable(wid) and self.workers.role_of(wid) != role:
                switches.append((wid, role))
        return await self._switch(switches)

    def _switchable(self, worker_id: str) -> bool:
        return self.workers.info(worker_id).role == WorkerRole.BOTH

    async def _switch(self, switches: Sequence[tuple[str, WorkerRole]]) -> list[str]:
        done = []
        for wid, role in switches:
            try:
                await switch_role(self.workers, self.migrations, wid, role)
                done.append(wid)
            except (KeyError, ValueError) as exc:  # gone or not switchable meanwhile
                logger.warning("role switch of %s to %s skipped: %s", wid, role.value, exc)
        return done

    def _shared(self, plan: Plan, kind: str) -> SharedPlan:
        """`plan` as published, with the replica counts for every worker the router knows,
        healthy or not (a worker down for a moment still tells which pools exist); none
        while it knows none (the pools' load rule applies)."""
        w = self.workers
        states = [WorkerState(wid, w.role_of(wid), info.role == WorkerRole.BOTH, 0)
                  for wid, info in w.infos.items()]
        replicas: tuple[tuple[str, int], ...] = ()
        if states:
            c = role_changes(states, plan)
            replicas = (("prefill", c.prefill_replicas), ("decode", c.decode_replicas),
                        ("both", c.switchable_replicas))
        prefill = tuple(wid for wid, info in w.infos.items() if info.role == WorkerRole.BOTH
                        and w.role_of(wid) == WorkerRole.PREFILL)
        return SharedPlan(self.replica, plan.prefill, plan.decode, plan.threshold_tokens,
                          plan.feasible, kind, plan.reason, replicas, prefill)

    async def step(self, router: Splits) -> None:
        """One tick: lead (plan for every replica's traffic, switch roles, publish) or follow
        the leader's fresh plan; either way the plan's threshold goes to `router.split`."""
        view = await self.board.tick(self.replica, self.traffic.classes(self.clock()))
        if view.leader != self.leader:
            logger.info("router %s %s the SLO planner's lease (holder: %s)", self.replica,
                        "took" if view.leader else "lost", view.holder)
        self.leader = view.leader
        if view.leader:
            before = self.plan
            plan = self.decide(view.traffic)
            if plan is None:
                return
            kind = decision_kind(before, plan) or (self.shared.kind if self.shared else "first")
            router.split = self.split_policy(router.split)
            await self.apply()
            self.shared = self._shared(plan, kind)
            await self.board.publish(self.shared)
        elif view.plan is not None:
            self.shared, self.plan, self.waiting = view.plan, None, None
            router.split = self.split_policy(router.split)
            await self.follow(view.plan)
        elif self.shared is None:
            self._wait(f"no fresh plan from the deciding replica ({view.holder})")

    def status(self) -> dict[str, object]:
        """The plan acted on, as `cleave status` shows it."""
        s = self.shared
        return {"leader": self.leader, "replica": self.replica,
                "decisions": dict(self.decisions), "waiting": self.waiting,
                "plan": None if s is None else {
                    "holder": s.holder, "prefill": s.prefill, "decode": s.decode,
                    "threshold": s.threshold, "feasible": s.feasible, "kind": s.kind,
                    "reason": s.reason, "replicas": dict(s.replicas)}}

    async def run(self, router: Splits) -> None:
        """`step` every `TICK_S`, until cancelled."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.step(router)
            except Exception:  # the next tick tries again
                logger.exception("the SLO planner's tick failed")


__all__ = ["Board", "LocalBoard", "SloControl"]
