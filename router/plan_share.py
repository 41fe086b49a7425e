"""One SLO planner among several router replicas, and the plan it shares. Torch-free, pure.

Every router replica runs an `SloControl`; one of them decides. `PlanBoard` (hosted by the
cluster's `Directory`, or in process by `LocalBoard` for a lone router) holds:

- a **lease**: the replica that ticks while no other holds an unexpired one takes it, and
  renews it every tick; a leader that stops ticking (killed, hung, partitioned) loses it after
  `LEASE_S` and the next replica to tick takes over, from its own traffic window onwards;
- each replica's **traffic** (its window's request classes, `TrafficWindow.classes`): every
  replica sees only the requests it admitted, so the leader plans for all of them;
- the leader's **plan** (`SharedPlan`): what the followers apply (its threshold and its role
  assignments of the switchable workers) and what each pool's autoscaling policy reads
  (`cluster.autoscaling`: its replica count). A plan not republished within `FRESH_S` is
  stale: it is not handed out, and the pools fall back to their load rule.

Times are the board's own `time.monotonic()` (one process's clock), never the replicas'.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.planner import AGGREGATED, Plan, RequestClass

LEASE_S = 5.0  # a leader that has not ticked for this long is replaced
FRESH_S = 10.0  # a plan older than this is not handed out (the pools' load rule applies)
PLAN_VERSION = 1


@dataclass(frozen=True)
class SharedPlan:
    """The leader's plan as other processes read it (router replicas, pool replicas)."""

    holder: str  # the router replica that decided it
    prefill: int  # the plan's prefill-pool workers
    decode: int  # its decode-pool workers (they run short prompts whole too)
    threshold_tokens: int  # planner.AGGREGATED: no prompt is handed off
    feasible: bool
    kind: str  # what changed (`decision_kind`): the metrics' `reason` label
    reason: str  # the planner's words
    # replicas per worker role ("prefill", "decode", "both": `RoleChanges`), what the pools
    # whose workers serve that role scale to
    replicas: tuple[tuple[str, int], ...] = ()
    # the switchable ("both") workers the leader routes as prefill workers; the others as
    # decode-pool workers
    prefill_workers: tuple[str, ...] = ()
    version: int = PLAN_VERSION

    def replicas_for(self, role: str) -> int | None:
        """The replica count for the pool of workers of `role`; None: the plan names none."""
        return dict(self.replicas).get(role)

    @property
    def threshold(self) -> str:
        """The threshold as people read it."""
        return threshold_words(self.threshold_tokens)


def threshold_words(tokens: int) -> str:
    """A disaggregation threshold as people read it: "aggregated" (no prompt handed off) or
    "N tokens"."""
    return "aggregated" if tokens >= AGGREGATED else f"{tokens} tokens"


@dataclass(frozen=True)
class BoardView:
    """What one tick reads back: whether this replica leads, every fresh replica's traffic
    (its own included), and the latest fresh plan."""

    leader: bool
    holder: str | None
    traffic: tuple[RequestClass, ...]
    plan: SharedPlan | None


def decision_kind(before: Plan | None, after: Plan) -> str | None:
    """Why `after` differs from `before` in a word (None: same workers and threshold):
    `infeasible` (the bounds cannot meet the targets), `scale_up`, `scale_down`,
    `layout` (the threshold moved), `rebalance` (the split between the pools moved), or
    `first`."""
    if before is not None and (before.prefill, before.decode, before.threshold_tokens) == (
            after.prefill, after.decode, after.threshold_tokens):
        return None
    if not after.feasible:
        return "infeasible"
    if before is None:
        return "first"
    if after.workers != before.workers:
        return "scale_up" if after.workers > before.workers else "scale_down"
    return "layout" if after.threshold_tokens != before.threshold_tokens else "rebalance"


@dataclass
class PlanBoard:
    """The lease, the replicas' traffic and the plan. Not thread-safe: one host calls it."""

    lease_s: float = LEASE_S
    fresh_s: float = FRESH_S
    holder: str | None = None
    _expires: float = 0.0
    _traffic: dict[str, tuple[float, tuple[RequestClass, ...]]] = field(default_factory=dict)
    _plan: tuple[float, SharedPlan] | None = None

    def tick(self, replica: str, traffic: tuple[RequestClass, ...], now: float) -> BoardView:
        """`replica`'s tick: record its traffic, take or renew the lease when it is free,
        expired or already its own."""
        if self.holder is None or self.holder == replica or now >= self._expires:
            self.holder, self._expires = replica, now + self.lease_s
        self._traffic[replica] = (now, traffic)
        for r in [r for r, (t, _) in self._traffic.items() if now - t > self.fresh_s]:
            del self._traffic[r]
        merged = tuple(c for _, classes in self._traffic.values() for c in classes)
        return BoardView(self.holder == replica, self.holder, merged, self.latest(now))

    def publish(self, plan: SharedPlan, now: float) -> bool:
        """Keep `plan` when its holder holds the lease now; False (dropped) otherwise."""
        if plan.holder != self.holder or now >= self._expires:
            return False
        self._plan = (now, plan)
        return True

    def latest(self, now: float) -> SharedPlan | None:
        """The last plan published, while fresh."""
        if self._plan is None or now - self._plan[0] > self.fresh_s:
            return None
        return self._plan[1]


__all__ = ["FRESH_S", "LEASE_S", "BoardView", "PlanBoard", "SharedPlan", "decision_kind",
           "threshold_words"]
