"""The SLO planner's metrics, on the router's `/metrics` (torch-free), read at each scrape
from its `SloControl`:

- `cleave_planner_leader`: 1 on the router replica that decides, 0 on the others;
- `cleave_planner_target_workers{pool}`: the acted-on plan's prefill and decode-pool workers
  (the leader's plan, on every replica);
- `cleave_planner_target_replicas{role}`: the replica counts it asks of the pools whose
  workers serve `role` ("prefill", "decode", "both");
- `cleave_planner_threshold_tokens`: its disaggregation threshold (+Inf: aggregated);
- `cleave_planner_feasible`: 0 when the pools' bounds cannot meet the targets;
- `cleave_planner_decisions_total{reason}`: this replica's decisions, by kind
  (`router.plan_share.decision_kind`);
- `cleave_planner_plan_info{holder, kind, threshold, feasible, reason}`: the acted-on plan
  with the planner's words for it (its predicted TTFT and ITL against the targets);
- `cleave_planner_waiting_info{reason}`: while there is no plan to act on, why.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily,
                                   Metric)
from prometheus_client.registry import Collector

from router.plan_share import SharedPlan
from router.planner import AGGREGATED


class PlanState(Protocol):
    """What the collector reads of the planner (`router.slo_control.SloControl`)."""

    @property
    def leader(self) -> bool: ...

    @property
    def shared(self) -> SharedPlan | None: ...

    @property
    def decisions(self) -> Mapping[str, int]: ...

    @property
    def waiting(self) -> str | None: ...


class PlanCollector(Collector):
    def __init__(self, slo: PlanState) -> None:
        self.slo = slo

    def collect(self) -> Iterator[Metric]:
        slo, plan = self.slo, self.slo.shared
        yield GaugeMetricFamily("cleave_planner_leader", "1 on the router replica whose SLO "
                                "planner decides", value=1.0 if slo.leader else 0.0)
        decisions = CounterMetricFamily("cleave_planner_decisions", "SLO planner decisions "
                                        "(plans changing workers or threshold), by kind",
                                        labels=["reason"])
        for kind, n in sorted(slo.decisions.items()):
            decisions.add_metric([kind], n)
        yield decisions
        if plan is None:
            yield InfoMetricFamily("cleave_planner_waiting", "Why the SLO planner has no plan "
                                   "to act on", value={"reason": slo.waiting or "unknown"})
            return
        yield InfoMetricFamily("cleave_planner_plan", "The SLO plan acted on and the "
                               "planner's reason for it", value={
                                   "holder": plan.holder, "kind": plan.kind,
                                   "threshold": plan.threshold,
                                   "feasible": str(plan.feasible).lower(),
                                   "reason": plan.reason})
        workers = GaugeMetricFamily("cleave_planner_target_workers", "Workers the SLO plan "
                                    "asks for, per pool", labels=["pool"])
        workers.add_metric(["prefill"], plan.prefill)
        workers.add_metric(["decode"], plan.decode)
        replicas = GaugeMetricFamily("cleave_planner_target_replicas", "Replicas the SLO "
                                     "plan asks of the pools serving a worker role",
                                     labels=["role"])
        for role, n in plan.replicas:
            replicas.add_metric([role], n)
        threshold = math.inf if plan.threshold_tokens >= AGGREGATED else plan.threshold_tokens
        yield from (workers, replicas, GaugeMetricFamily(
            "cleave_planner_threshold_tokens", "The SLO plan's disaggregation threshold, "
            "uncached prompt tokens (+Inf: aggregated)", value=threshold),
            GaugeMetricFamily("cleave_planner_feasible", "1 when the SLO plan meets the "
                              "targets within the pools' bounds", value=float(plan.feasible)))


__all__ = ["PlanCollector", "PlanState"]
