"""The SLO planner's loop in a router replica, on when `RouterConfig.slo_ttft_ms` and
`slo_itl_ms` are set. Torch-free.

It records every request's prompt and output length as it arrives (`arrived`) and every
worker's pushed load (`observe`, one report per engine step): a report that follows a pure
decode step is that step's cost at its batch, fitted into a `StepProfile` with the measured
prefill rate (`router.profiles.ProfileFitter`). Each `tick` (every `TICK_S`) plans
(`router.planner.SloPlanner`) within the workers the router has, then applies what a router
can: the split policy's threshold (when the policy is `uncached_threshold`) and the role
switches of the workers started as "both" (`router.role_plan`, `router.role_switch`), one at
a time. Each new plan's reason is logged and kept as `plan`. Not yet: Serve's replica counts
(`RoleChanges` has them; the cluster does not read them), and a choice of one router replica
to decide when there are several (each would switch roles on its own).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from router.config import RouterConfig
from router.live_migration import LiveMigrations
from router.planner import Plan, PlanInput, PoolBounds, SloPlanner, SloTargets
from router.profiles import ProfileFitter
from router.role_plan import RoleChanges, WorkerState, role_changes
from router.role_switch import switch_role
from router.split_policy import SplitPolicy, UncachedThreshold
from router.traffic import TrafficWindow
from router.workers import WorkerSet
from workers.contract.protocol import EngineStats, WorkerRole

logger = logging.getLogger(__name__)

TICK_S = 1.0
MAX_STEP_S = 10.0  # a longer interval between two reports is idleness, not a step


class Splits(Protocol):
    """What holds the router's "hand off or run here" policy (the orchestrator)."""

    split: SplitPolicy


class SloControl:
    """The planner's inputs, its plan, and what the router applies of it. Event-loop thread."""

    def __init__(self, config: RouterConfig, workers: WorkerSet,
                 migrations: LiveMigrations) -> None:
        if config.slo_ttft_ms is None or config.slo_itl_ms is None:
            raise ValueError(f"the SLO planner needs slo_ttft_ms and slo_itl_ms, got "
                             f"{config.slo_ttft_ms} and {config.slo_itl_ms}")
        self.targets = SloTargets(config.slo_ttft_ms / 1000, config.slo_itl_ms / 1000,
                                  config.slo_percentile)
        self.workers, self.migrations = workers, migrations
        self.traffic = TrafficWindow()
        self.fitter = ProfileFitter()
        self.planner = SloPlanner()
        self.plan: Plan | None = None
        self.changes: RoleChanges | None = None
        self._last: dict[str, tuple[float, bool]] = {}  # worker -> (report time, pure decode)

    def arrived(self, prompt_tokens: int, output_tokens: int) -> None:
        self.traffic.arrived(time.monotonic(), prompt_tokens, output_tokens)

    def observe(self, worker_id: str, stats: EngineStats) -> None:
        """A worker's pushed load (`WorkerSet.observers`)."""
        now = time.monotonic()
        pure = (stats.num_running > 0 and stats.num_waiting == 0
                and stats.num_pending_prompt_tokens == 0)
        last = self._last.get(worker_id)
        if last is not None and last[1] and pure and now - last[0] < MAX_STEP_S:
            self.fitter.observe_decode(stats.num_running, 0.0, now - last[0])
        self._last[worker_id] = (now, pure)
        self.fitter.observe_prefill_rate(stats.prefill_s_per_token)

    def decide(self) -> Plan | None:
        """This tick's plan, or None while there is no traffic or no profile yet."""
        classes = self.traffic.classes(time.monotonic())
        profile = self.fitter.profile()
        if not classes or profile is None:
            return None
        table = self.workers.loads()
        backlog = float(table.pending[table.rows].sum())
        bounds = PoolBounds(max_workers=max(1, len(self.workers.clients)))
        plan = self.planner.decide(PlanInput(classes, profile, self.targets, bounds, backlog))
        if self.plan is None or (plan.prefill, plan.decode, plan.threshold_tokens) != (
                self.plan.prefill, self.plan.decode, self.plan.threshold_tokens):
            logger.info("SLO plan: %s", plan.reason)
        self.plan = plan
        return plan

    def split_policy(self, current: SplitPolicy) -> SplitPolicy:
        """`current`, with the plan's threshold when it is the threshold policy."""
        if self.plan is None or not isinstance(current, UncachedThreshold) or \
                current.threshold_tokens == self.plan.threshold_tokens:
            return current
        return UncachedThreshold(self.plan.threshold_tokens)

    async def apply(self) -> list[str]:
        """Switch the roles the plan asks for; the workers switched."""
        if self.plan is None:
            return []
        w = self.workers
        states = [WorkerState(wid, w.role_of(wid), w.info(wid).role == WorkerRole.BOTH,
                              len(self.migrations.on(wid)))
                  for wid in w.healthy_workers()]
        self.changes = role_changes(states, self.plan)
        done = []
        for wid, role in self.changes.switches:
            try:
                await switch_role(w, self.migrations, wid, role)
                done.append(wid)
            except (KeyError, ValueError) as exc:  # gone or not switchable meanwhile
                logger.warning("role switch of %s to %s skipped: %s", wid, role.value, exc)
        return done

    async def run(self, router: Splits) -> None:
        """Every `TICK_S`: plan, apply the threshold to `router.split` and switch roles. Runs
        until cancelled."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                if self.decide() is not None:
                    router.split = self.split_policy(router.split)
                    await self.apply()
            except Exception:  # the next tick tries again
                logger.exception("the SLO planner's tick failed")


__all__ = ["SloControl"]
