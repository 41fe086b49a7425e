"""Per-pool autoscaling: the policy Ray Serve calls with the replicas' reported load.

Each pool replica reports `pending_prompt_tokens`, `kv_usage` and `running_seqs`
(`WorkerReplica.record_autoscaling_stats`). A prefill pool scales on pending prompt tokens, a
decode or aggregated pool on KV occupancy and running sequences, whichever asks for more:

    up:   desired = ceil(total / target)                      when total > current × target
    down: desired = ceil(total / (target × (1 - hysteresis)))  when that is below current

With SLO targets set (`router.slo_ttft_ms` and `slo_itl_ms`), the router replicas' leading
planner publishes the replica count each pool should have (`router.plan_share.SharedPlan`),
and each replica reports it with its load (`PLAN_SIGNAL`) while the plan is fresh. The plan's
count then wins over the load rule: it is sized for the targets from the traffic and the
measured step costs, and it keeps the fewest workers that meet them, where the load rule
would hold a replica per `target_*` of load whatever the latency. With no fresh plan (no
targets, no leader for `router.plan_share.FRESH_S`, a restarted directory) the load rule
decides. Either way the result is clamped to [min, max] and Serve applies the up/down
delays; a replica chosen for removal drains first (`cluster.pool`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

PLAN_SIGNAL = "plan_replicas"  # the SLO plan's replica count for the pool
PREFILL_SIGNALS = ("pending_prompt_tokens",)
DECODE_SIGNALS = ("kv_usage", "running_seqs")


@dataclass(frozen=True)
class Targets:
    """Per-replica targets of one pool: signal name -> the load one replica should carry."""

    per_replica: Mapping[str, float]
    hysteresis: float = 0.2


def desired_replicas(current: int, totals: Mapping[str, float], targets: Targets) -> int:
    """Replicas for the pool's total load per signal (unbounded: Serve applies min/max).
    Signals with no reports count as no load."""
    current = max(current, 0)
    wants = []
    for signal, target in targets.per_replica.items():
        total = max(0.0, totals.get(signal, 0.0))
        if total > current * target:
            wants.append(math.ceil(total / target))
            continue
        down = math.ceil(total / (target * (1 - targets.hysteresis)))
        wants.append(min(current, down))
    return max(wants, default=current)


def planned_replicas(metrics: Mapping[str, Mapping[Any, float]]) -> int | None:
    """The SLO plan's count as the pool's replicas reported it (None: none reported it: no
    fresh plan). Averaged over Serve's look-back window, a count that changed within it
    rounds up."""
    values = metrics.get(PLAN_SIGNAL) or {}
    return math.ceil(max(values.values())) if values else None


class PoolPolicy:
    """Serve's custom autoscaling policy (`AutoscalingPolicy(policy_function=
    "cluster.autoscaling:PoolPolicy", policy_kwargs=...)`), one instance per pool."""

    def __init__(self, per_replica: dict[str, float], hysteresis: float = 0.2) -> None:
        unknown = set(per_replica) - set(PREFILL_SIGNALS) - set(DECODE_SIGNALS)
        if unknown:
            raise ValueError(f"unknown autoscaling signals {sorted(unknown)}; expected some of "
                             f"{sorted(PREFILL_SIGNALS + DECODE_SIGNALS)}")
        self.targets = Targets(dict(per_replica), hysteresis)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        totals = {name: float(sum(metrics.get(name, {}).values()))
                  for name in self.targets.per_replica}
        planned = planned_replicas(metrics)
        if planned is None:
            desired, rule = desired_replicas(pool_size(ctx), totals, self.targets), "load"
        else:
            desired, rule = planned, "slo_plan"
        desired = min(max(desired, ctx.capacity_adjusted_min_replicas),
                      ctx.capacity_adjusted_max_replicas)
        return desired, {**ctx.policy_state, "cleave_totals": totals, "cleave_rule": rule}


def pool_size(ctx: Any) -> int:
    """The pool's size as last decided: Serve's target count, which counts the replicas still
    starting. (`current_num_replicas` counts only running ones: measured against it, a load
    that just asked for a second replica reads as one replica's worth while that replica
    starts, and the pool scales down again, stopping the replica before it runs.)"""
    target = getattr(ctx, "target_num_replicas", None)
    return ctx.current_num_replicas if target is None else int(target)


def policy_kwargs(pool: str, autoscaling: Any) -> dict[str, Any]:
    """`PoolPolicy` arguments for a pool's `AutoscalingSettings`."""
    if pool == "prefill":
        per_replica = {"pending_prompt_tokens": float(autoscaling.target_waiting_tokens)}
    else:
        per_replica = {"kv_usage": autoscaling.target_kv_usage,
                       "running_seqs": float(autoscaling.target_running_seqs)}
    return {"per_replica": per_replica, "hysteresis": autoscaling.hysteresis}
