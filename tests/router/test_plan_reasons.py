"""What an operator reads of the SLO planner's decisions: each decision's reason in the log
line, on `/metrics` (`cleave_planner_plan_info{reason}`) and in `cleave status`, a pool the
plan empties shown at 0 replicas, and, while there is no plan, why not. The planner's clock is
a list the test moves; nothing sleeps."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import pytest

from cluster.status import format_status, planner_lines
from router.config import RouterConfig
from router.counters import RouterCounters
from router.live_migration import LiveMigrations
from router.metrics import RouterMetrics
from router.plan_share import PlanBoard
from router.profiles import ProfileFitter, StepProfile
from router.slo_control import LocalBoard, SloControl
from router.split_policy import SplitPolicy, UncachedThreshold
from router.workers import WorkerSet
from tests.router.fakes import FakeWorker

# a 2,048-token prompt takes 0.4 s to prefill; a decode step 10 ms + 1 ms a sequence
PROFILE = StepProfile(0.0, 2e-4, 0.01, 0.001)


@dataclass
class Splits:
    split: SplitPolicy


class Replica:
    """A router replica's planner over two "both" workers, on a board and a clock it shares."""

    def __init__(self, name: str, board: LocalBoard, now: list[float]) -> None:
        self.name, self.board, self.now = name, board, now

    async def start(self) -> Replica:
        self.ws = WorkerSet([FakeWorker("w0"), FakeWorker("w1")])
        await self.ws.start()
        self.metrics = RouterMetrics(self.ws, RouterCounters(), lambda: 0)
        self.slo = SloControl(RouterConfig("fake-model", slo_ttft_ms=2000, slo_itl_ms=50),
                              self.ws, LiveMigrations(self.ws, RouterCounters()),
                              self.metrics.registry, clock=lambda: self.now[0])
        self.slo.board, self.slo.replica = self.board, self.name
        self.splits = Splits(UncachedThreshold(512))
        return self

    async def tick(self) -> None:
        await self.slo.step(self.splits)

    def shown(self) -> str:
        return "\n".join(planner_lines(self.slo.status()))

    def scraped(self) -> str:
        return self.metrics.exposition().decode()

    def arrive(self, prompt: int, output: int, n: int) -> None:
        """`n` requests over the last second of the planner's clock."""
        for i in range(n):
            self.slo.traffic.arrived(self.now[0] - 1 + i / n, prompt, output)


def replicas(*names: str) -> tuple[list[float], list[Replica]]:
    now = [100.0]
    board = LocalBoard(PlanBoard(lease_s=5.0), clock=lambda: now[0])
    return now, [asyncio.run(Replica(n, board, now).start()) for n in names]


def test_without_a_plan_status_and_metrics_say_why(caplog: pytest.LogCaptureFixture) -> None:
    now, (r,) = replicas("router-a")
    caplog.set_level(logging.INFO, logger="router.slo_control")
    asyncio.run(r.tick())  # no requests yet
    assert "SLO planner: no plan: no requests in the last 15 s (router router-a decides" \
        in r.shown()
    assert 'cleave_planner_waiting_info{reason="no requests in the last 15 s"} 1.0' \
        in r.scraped()
    r.arrive(128, 64, 4)
    now[0] += 1.0
    asyncio.run(r.tick())  # requests, but no worker has pushed a step yet
    assert "no plan: no step profile yet" in r.shown()
    assert 'cleave_planner_waiting_info{reason="no step profile yet' in r.scraped()
    said = [m for m in caplog.messages if "has no plan" in m]
    assert len(said) == 2 and "no step profile yet" in said[1]  # each change once
    asyncio.run(r.tick())
    assert len([m for m in caplog.messages if "has no plan" in m]) == 2
    assert "cleave_planner_plan_info" not in r.scraped()


def test_each_decision_is_logged_exported_and_shown_with_its_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    now, (r,) = replicas("router-a")
    r.slo.fitter = ProfileFitter(PROFILE)
    caplog.set_level(logging.INFO, logger="router.slo_control")
    r.arrive(128, 64, 2)  # chat: aggregated, no prefill pool
    asyncio.run(r.tick())
    first = r.slo.shared
    assert first is not None and first.kind == "first" and first.prefill == 0
    logged = [m for m in caplog.messages if m.startswith("SLO plan (first, router router-a)")]
    assert len(logged) == 1 and "threshold aggregated" in logged[0], caplog.messages
    assert str(1 << 30) not in logged[0]  # the threshold in words, not its sentinel
    assert logged[0].endswith(f"why: {first.reason}")
    shown = r.shown()
    # the prefill and decode pools the plan leaves empty are shown at 0, not left out
    assert f"replicas asked: prefill 0, decode 0, both {first.decode};" in shown
    assert f"why: {first.reason}" in shown and "no plan" not in shown
    scraped = r.scraped()
    assert (f'cleave_planner_plan_info{{feasible="true",holder="router-a",kind="first",'
            f'reason="{first.reason}",threshold="aggregated"}} 1.0') in scraped
    assert "cleave_planner_waiting_info" not in scraped
    # the mix moves to long prompts: a new decision, with its own reason everywhere
    now[0] += 20.0
    r.arrive(2048, 16, 4)
    asyncio.run(r.tick())
    second = r.slo.shared
    assert second is not None and second.kind != "first" and second.prefill == 1, second
    assert second.reason != first.reason and "threshold" in second.reason
    logged = [m for m in caplog.messages if m.startswith(f"SLO plan ({second.kind}")]
    assert len(logged) == 1 and logged[0].endswith(f"why: {second.reason}")
    assert f"why: {second.reason}" in r.shown()
    assert f'reason="{second.reason}"' in r.scraped()
    assert f'cleave_planner_decisions_total{{reason="{second.kind}"}} 1.0' in r.scraped()


def test_a_follower_without_the_leaders_plan_says_whose_it_waits_for() -> None:
    _, (a, b) = replicas("router-a", "router-b")
    asyncio.run(a.tick())  # a holds the lease, has no plan (no requests)
    asyncio.run(b.tick())
    assert ("no plan: no fresh plan from the deciding replica (router-a) (router router-b "
            "follows") in b.shown()
    a.slo.fitter = ProfileFitter(PROFILE)
    a.arrive(128, 64, 2)
    asyncio.run(a.tick())
    asyncio.run(b.tick())
    assert b.slo.waiting is None and "decided by router-a" in b.shown()
    assert 'holder="router-a"' in b.scraped()


def test_status_shows_a_pool_scaled_to_zero_replicas() -> None:
    s = {"application": "RUNNING", "model": "m", "router": "r0", "workers": [],
         "deployments": {"prefill": {"status": "HEALTHY", "replicas": {"running": 0}},
                         "decode": {"status": "HEALTHY", "replicas": {"running": 2}}},
         "num_requests": 0, "num_prompt_tokens": 0, "prefix_hit_rate": None,
         "predicted_prefix_hit_rate": None, "fallbacks": {},
         "planner": {"leader": True, "replica": "r0", "decisions": {"scale_down": 1},
                     "waiting": None, "plan": {
                         "holder": "r0", "prefill": 0, "decode": 2, "threshold": "aggregated",
                         "feasible": True, "kind": "scale_down", "reason": "aggregated: ...",
                         "replicas": {"both": 0, "decode": 2, "prefill": 0}}}}
    text = format_status(s)
    assert "prefill          healthy    0 replicas" in text
    assert "decode           healthy    2 running" in text
    assert "replicas asked: prefill 0, decode 2, both 0;" in text
    assert "SLO planner: 0 prefill + 2 decode workers, threshold aggregated, scale_down" in text
