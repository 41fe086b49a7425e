"""The SLO plan drives the pools' replica counts (no Ray): the leading router replica's plan,
published on the directory, reaches each pool's autoscaling policy through the load its
replicas report; the policy follows it within the pool's min/max, and its load rule when
there is no fresh plan. `cleave status` shows the plan, who decided it and why."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cluster.autoscaling import PLAN_SIGNAL, PoolPolicy
from cluster.config import CleaveConfig
from cluster.directory import Directory
from cluster.plan_board import DirectoryBoard, plan_bounds
from cluster.pool import WorkerReplica
from cluster.status import format_status
from router.plan_share import SharedPlan
from router.planner import RequestClass
from workers.contract.protocol import EngineStats


class Remote:
    """A deployment or actor handle over a local object: `h.method.remote(...)` awaits it."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.target, name)

        class _Call:
            @staticmethod
            async def remote(*args: Any) -> Any:
                return method(*args)

        return _Call


@dataclass
class Ctx:
    """Serve's `AutoscalingContext`, as much as the policy reads."""

    aggregated_metrics: dict[str, dict[str, float]]
    current_num_replicas: int = 2
    capacity_adjusted_min_replicas: int = 1
    capacity_adjusted_max_replicas: int = 4
    policy_state: dict[str, Any] = field(default_factory=dict)


SLO = {"router": {"slo_ttft_ms": 500.0, "slo_itl_ms": 50.0}}


def replica_of(pool: str, directory: Any, config: dict[str, Any] = SLO) -> WorkerReplica:
    """A pool replica with its engine and directory as local objects (no Serve)."""
    r = WorkerReplica.__new__(WorkerReplica)
    r.pool, r.directory, r.config = pool, Remote(directory), CleaveConfig.parse(config)

    class Engine:
        def stats(self) -> EngineStats:
            return EngineStats(num_waiting=0, num_running=30, kv_usage=0.95,
                               num_free_blocks=1, num_cached_blocks=0, num_blocks=16)

    r.actor = Remote(Engine())
    return r


def plan(holder: str, both: int) -> SharedPlan:
    return SharedPlan(holder, 1, both - 1, 0, True, "scale_up", "a prefill pool pays off",
                      (("prefill", 0), ("decode", 0), ("both", both)), ("w0",))


def test_the_leaders_plan_sets_the_pools_replicas_within_its_bounds():
    async def run() -> None:
        d = Directory()
        board_a, board_b = DirectoryBoard(Remote(d)), DirectoryBoard(Remote(d))
        assert (await board_a.tick("router-a", (RequestClass(1.0, 2048, 16),))).leader
        assert not (await board_b.tick("router-b", ())).leader
        assert not await board_b.publish(plan("router-b", 4))  # a follower's plan is dropped
        pool = replica_of("aggregated", d)
        heavy = await pool.record_autoscaling_stats()  # KV nearly full, 30 running
        assert PLAN_SIGNAL not in heavy  # no plan yet: the load rule decides
        policy = PoolPolicy({"kv_usage": 0.7, "running_seqs": 8.0})
        by_load = {k: {"r1": v, "r2": v} for k, v in heavy.items()}
        assert policy(Ctx(by_load)) == (4, {"cleave_totals": {"kv_usage": 1.9,
                                                               "running_seqs": 60.0},
                                            "cleave_rule": "load"})
        assert await board_a.publish(plan("router-a", 3))
        reported = await pool.record_autoscaling_stats()
        assert reported[PLAN_SIGNAL] == 3.0  # the "both" workers' count, for the aggregated pool
        with_plan = {k: {"r1": v, "r2": v} for k, v in reported.items()}
        desired, state = policy(Ctx(with_plan))
        assert (desired, state["cleave_rule"]) == (3, "slo_plan")  # the plan wins over load
        assert policy(Ctx({PLAN_SIGNAL: {"r1": 9.0}}))[0] == 4  # clamped to max
        assert policy(Ctx({PLAN_SIGNAL: {"r1": 0.0}}))[0] == 1  # and to min
        # the plan changed within Serve's look-back window: the count rounds up
        assert policy(Ctx({PLAN_SIGNAL: {"r1": 2.5, "r2": 2.0}}))[0] == 3
        # a dedicated prefill pool reads its own count from the same plan
        assert (await replica_of("prefill", d).record_autoscaling_stats())[PLAN_SIGNAL] == 0.0

    asyncio.run(run())


def test_the_planner_plans_within_the_pools_replica_bounds():
    agg = CleaveConfig.parse({"pools": {"aggregated": {"replicas": {"min": 1, "max": 6}}}})
    b = plan_bounds(agg)
    assert (b.min_prefill, b.max_prefill, b.max_decode, b.max_workers) == (0, 6, 6, 6)
    split = CleaveConfig.parse({"pools": {"prefill": {"replicas": {"min": 0, "max": 2}},
                                          "decode": {"replicas": {"min": 1, "max": 3}}}})
    b = plan_bounds(split)
    assert (b.min_prefill, b.max_prefill, b.min_decode, b.max_decode, b.max_workers) == \
        (0, 2, 1, 3, 5)


def test_status_shows_the_plan_who_decided_it_and_why():
    planner = {"leader": False, "replica": "router-b", "decisions": {},
               "plan": {"holder": "router-a", "prefill": 1, "decode": 2,
                        "threshold": "512 tokens", "feasible": True, "kind": "scale_up",
                        "reason": "threshold 512: 1 prefill for 3/s", "replicas": {"both": 3}}}
    report = {"application": "RUNNING", "model": "tiny", "deployments": {}, "router": "r0",
              "workers": [], "num_requests": 3, "num_prompt_tokens": 10,
              "prefix_hit_rate": None, "predicted_prefix_hit_rate": None, "fallbacks": {},
              "planner": planner}
    text = format_status(report)
    assert ("SLO planner: 1 prefill + 2 decode workers, threshold 512 tokens, scale_up; "
            "decided by router-a") in text
    assert "replicas asked: both 3; this replica follows" in text
    assert "why: threshold 512: 1 prefill for 3/s" in text
    report["planner"] = None  # no SLO targets: no planner line
    assert "SLO planner" not in format_status(report)


def test_without_slo_targets_a_replica_reports_its_load_and_never_asks_for_a_plan():
    asked: list[str] = []

    class Watched:
        def plan(self) -> None:
            asked.append("plan")

    reported = asyncio.run(replica_of("decode", Watched(), {}).record_autoscaling_stats())
    assert PLAN_SIGNAL not in reported and reported["running_seqs"] == 30.0
    assert asked == []  # not a directory call a metrics interval where no planner runs
