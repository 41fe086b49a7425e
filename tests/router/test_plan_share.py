"""One SLO planner among router replicas: the lease's holder decides for every replica's
traffic and publishes; the others follow its threshold and role assignments; when it stops
ticking another takes over. Decisions are counted by kind and exported."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from cluster.status import planner_lines
from router.config import RouterConfig
from router.counters import RouterCounters
from router.live_migration import LiveMigrations
from router.metrics import RouterMetrics
from router.plan_share import PlanBoard, SharedPlan, decision_kind
from router.planner import AGGREGATED, Plan, RequestClass
from router.profiles import ProfileFitter, StepProfile
from router.role_plan import WorkerState, role_changes
from router.slo_control import LocalBoard, SloControl
from router.split_policy import SplitPolicy, UncachedThreshold
from router.workers import WorkerSet
from tests.router.fakes import FakeWorker
from workers.contract.protocol import WorkerRole

PROFILE = StepProfile(0.0, 2e-4, 0.01, 0.001)  # 2048-token prompt: 0.4 s to prefill


SCRAPES: dict[int, RouterMetrics] = {}


@dataclass
class Splits:
    split: SplitPolicy


async def replica(name: str, board: LocalBoard) -> tuple[SloControl, WorkerSet, Splits]:
    """A router replica's planner over its own view of the same two "both" workers."""
    ws = WorkerSet([FakeWorker("w0"), FakeWorker("w1")])
    await ws.start()
    cfg = RouterConfig("fake-model", slo_ttft_ms=2000, slo_itl_ms=50)
    metrics = RouterMetrics(ws, RouterCounters(), lambda: 0)
    slo = SloControl(cfg, ws, LiveMigrations(ws, RouterCounters()), metrics.registry)
    slo.fitter = ProfileFitter(PROFILE)
    slo.board, slo.replica = board, name
    SCRAPES[id(slo)] = metrics
    return slo, ws, Splits(UncachedThreshold(512))


def summarize(slo: SloControl, rate: float = 1.0, seconds: float = 10.0) -> None:
    """Long prompts, short answers over the last `seconds`: a prefill worker pays off."""
    now = time.monotonic()
    for i in range(int(rate * seconds)):
        slo.traffic.arrived(now - seconds + i / rate, 2048, 16)


def test_the_lease_holder_decides_and_the_other_replica_follows_then_takes_over():
    async def run() -> None:
        now = [0.0]
        board = LocalBoard(PlanBoard(lease_s=5.0), clock=lambda: now[0])
        a, a_workers, a_split = await replica("router-a", board)
        b, b_workers, b_split = await replica("router-b", board)
        summarize(b)  # only b saw the traffic: a plans for it all the same
        for _ in range(2):  # a takes the lease; b reports its traffic; a plans; b follows
            await a.step(a_split)
            await b.step(b_split)
        assert a.leader and not b.leader
        assert b.plan is None and b.decisions == {}  # b never planned
        plan = a.shared
        assert plan is not None and plan.holder == "router-a" and plan.prefill == 1
        assert a.decisions == {plan.kind: 1}
        # the pool of "both" workers is asked for every worker the plan needs
        assert plan.replicas_for("both") == plan.prefill + plan.decode == 2
        # b routes as a does: the same worker as prefill, the same threshold
        assert b.shared == plan
        assert [w for w in ("w0", "w1") if b_workers.role_of(w) == WorkerRole.PREFILL] == \
            [w for w in ("w0", "w1") if a_workers.role_of(w) == WorkerRole.PREFILL] == \
            list(plan.prefill_workers)
        assert isinstance(b_split.split, UncachedThreshold)
        assert b_split.split.threshold_tokens == plan.threshold_tokens == \
            a_split.split.threshold_tokens  # type: ignore[attr-defined]
        shown = "\n".join(planner_lines(b.status()))  # `cleave status` on b's replica
        assert "decided by router-a" in shown and "this replica follows" in shown
        assert f"why: {plan.reason}" in shown
        assert b"cleave_planner_leader 1.0" in _scrape(a)
        assert b"cleave_planner_leader 0.0" in _scrape(b)
        assert b'cleave_planner_target_workers{pool="prefill"} 1.0' in _scrape(b)
        # a stops ticking (killed): b takes the lease once it lapses and decides from then on
        now[0] += 5.0
        await b.step(b_split)
        assert b.leader and b.shared is not None and b.shared.holder == "router-b"
        assert sum(b.decisions.values()) == 1
        assert b'cleave_planner_decisions_total{reason="' in _scrape(b)
        await a.step(a_split)  # a comes back: it follows now
        assert not a.leader and a.shared == b.shared

    asyncio.run(run())


def _scrape(slo: SloControl) -> bytes:
    """The router's `/metrics` body (the planner's collector is on its registry)."""
    return SCRAPES[id(slo)].exposition()


def _shared(holder: str) -> SharedPlan:
    return SharedPlan(holder, 1, 2, 512, True, "first", "why", (("both", 3),), ("w0",))


def test_only_the_holder_publishes_and_a_stale_plan_is_not_handed_out():
    board = PlanBoard(lease_s=5.0, fresh_s=10.0)
    chat = (RequestClass(2.0, 100, 50),)
    assert board.tick("a", chat, now=0.0).leader
    view = board.tick("b", (RequestClass(1.0, 2000, 10),), now=1.0)
    assert not view.leader and view.holder == "a"
    assert sorted(c.rate for c in view.traffic) == [1.0, 2.0]  # every replica's traffic
    assert not board.publish(_shared("b"), now=1.0)
    assert board.publish(_shared("a"), now=1.0)
    assert board.tick("b", (), now=2.0).plan == _shared("a")
    assert board.latest(now=11.5) is None  # not republished: the pools' load rule applies
    assert board.tick("b", (), now=7.0).leader  # a's lease lapsed at 5.0


def test_a_decision_is_named_for_what_it_changes():
    def plan(p: int, d: int, t: int = AGGREGATED, feasible: bool = True) -> Plan:
        return Plan(p, d, t, feasible, 0.1, 0.01, "")

    assert decision_kind(None, plan(0, 2)) == "first"
    assert decision_kind(plan(0, 2), plan(0, 2)) is None
    assert decision_kind(plan(0, 2), plan(1, 2, 512)) == "scale_up"
    assert decision_kind(plan(1, 2), plan(0, 2)) == "scale_down"
    assert decision_kind(plan(1, 2, 512), plan(1, 2, 1024)) == "layout"
    assert decision_kind(plan(1, 2, 512), plan(2, 1, 512)) == "rebalance"
    assert decision_kind(plan(1, 2), plan(3, 3, feasible=False)) == "infeasible"


def test_dedicated_pools_grow_to_the_plan_when_nothing_can_switch():
    plan = Plan(2, 3, 512, True, 0.1, 0.01, "")
    ws = [WorkerState("p0", WorkerRole.PREFILL, False, 0),
          WorkerState("d0", WorkerRole.DECODE, False, 0)]
    changes = role_changes(ws, plan)
    assert (changes.prefill_replicas, changes.decode_replicas) == (2, 3)
    assert changes.switchable_replicas == 0 and changes.switches == ()
