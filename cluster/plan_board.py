"""The SLO planner on the Ray app: its router replicas meet on the `Directory`'s `PlanBoard`
(`router.plan_share`), and plan within the pools' replica bounds.

`DirectoryBoard` is the `router.slo_control.Board` a router replica's `SloControl` ticks on;
`plan_bounds` turns the pools' `replicas.min`/`max` into the planner's `PoolBounds`, so the
plan's workers are replica counts the pools can take (`cluster.autoscaling` follows them).
"""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.config import CleaveConfig
from router.plan_share import BoardView, SharedPlan
from router.planner import PoolBounds, RequestClass

BOARD_TIMEOUT_S = 2.0  # a directory that does not answer within this misses one tick


class DirectoryBoard:
    """The board on the `Directory` deployment (`handle`); raises `TimeoutError` when it does
    not answer (the planner's tick is skipped: `SloControl.run`)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    async def tick(self, replica: str, traffic: tuple[RequestClass, ...]) -> BoardView:
        view: BoardView = await asyncio.wait_for(
            self.handle.plan_tick.remote(replica, traffic), BOARD_TIMEOUT_S)
        return view

    async def publish(self, plan: SharedPlan) -> bool:
        kept: bool = await asyncio.wait_for(self.handle.publish_plan.remote(plan),
                                            BOARD_TIMEOUT_S)
        return kept


def plan_bounds(config: CleaveConfig) -> PoolBounds:
    """The planner's bounds from the pools': an aggregated pool's workers serve either pool
    (role switches), dedicated pools only their own."""
    pools = config.pools
    if pools.aggregated is not None:
        r = pools.aggregated.replicas
        return PoolBounds(0, r.max, 1, r.max, r.max)
    p = pools.prefill.replicas if pools.prefill is not None else None
    d = pools.decode.replicas if pools.decode is not None else None
    if d is None:  # config validation guarantees a decode pool without an aggregated one
        raise ValueError("a deployment without an aggregated pool needs a decode pool")
    min_p, max_p = (p.min, p.max) if p is not None else (0, 0)
    min_d = max(1, d.min)
    max_d = max(d.max, min_d)
    return PoolBounds(min_p, max_p, min_d, max_d, max_p + max_d)


__all__ = ["DirectoryBoard", "plan_bounds"]
