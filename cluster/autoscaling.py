"""Per-pool autoscaling: the policy Ray Serve calls with the replicas' reported load.

Each pool replica reports `pending_prompt_tokens`, `kv_usage` and `running_seqs`
(`WorkerReplica.record_autoscaling_stats`). A prefill pool scales on pending prompt tokens, a
decode or aggregated pool on KV occupancy and running sequences, whichever asks for more:

    up:   desired = ceil(total / target)                      when total > current × target
    down: desired = ceil(total / (target × (1 - hysteresis)))  when that is below current

Serve clamps the result to [min, max] and applies the up/down delays; a replica chosen for
removal drains first (`cluster.pool`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

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
        desired = desired_replicas(ctx.current_num_replicas, totals, self.targets)
        return desired, {**ctx.policy_state, "cleave_totals": totals}


def policy_kwargs(pool: str, autoscaling: Any) -> dict[str, Any]:
    """`PoolPolicy` arguments for a pool's `AutoscalingSettings`."""
    if pool == "prefill":
        per_replica = {"pending_prompt_tokens": float(autoscaling.target_waiting_tokens)}
    else:
        per_replica = {"kv_usage": autoscaling.target_kv_usage,
                       "running_seqs": float(autoscaling.target_running_seqs)}
    return {"per_replica": per_replica, "hysteresis": autoscaling.hysteresis}
