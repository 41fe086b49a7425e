"""Carrying out a plan: which workers switch role, and how many replicas each pool keeps.
Torch-free, pure (the router's `switch_role` does the switching: `router.app`).

A worker whose engine serves both halves (started with role "both") is a switchable worker:
the router assigns it the prefill or the decode-pool role (`WorkerSet.assign_role`) and
changes it in place, so switchable workers are one Serve deployment whose replica count is
what the plan needs beyond the dedicated pools; a role switch is faster than a replica start
(its streams move away by live migration, its cached prefixes stay). Dedicated workers
(started "prefill" or "decode") never switch; their pools shrink when the plan needs fewer
than they hold, and grow only where there is no switchable worker to grow (a deployment has
either an aggregated pool or prefill/decode pools: `cluster.config.PoolsSettings`).

`role_changes` switches the fewest workers, those with the fewest running streams first (the
least to migrate); a worker switching to prefill must be emptied of its streams first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.planner import Plan
from workers.contract.protocol import WorkerRole


@dataclass(frozen=True)
class WorkerState:
    """One worker as the actuator sees it."""

    worker_id: str
    role: WorkerRole  # as routed now: PREFILL, or DECODE / BOTH (the decode pool)
    switchable: bool  # its engine serves both halves (started with role "both")
    running: int  # streams running there (what a switch to prefill moves away)


@dataclass(frozen=True)
class RoleChanges:
    """What to do for a plan: role switches (worker, its new role) and replica counts."""

    switches: tuple[tuple[str, WorkerRole], ...]
    switchable_replicas: int  # the switchable deployment's replica count
    prefill_replicas: int  # the dedicated pools'
    decode_replicas: int


@dataclass(frozen=True)
class RoleSwitch:
    """A role switch done (`Router.switch_role`): the streams moved away and how long it
    took, seconds."""

    worker_id: str
    before: WorkerRole
    after: WorkerRole
    moved: int
    seconds: float


def in_prefill(role: WorkerRole) -> bool:
    return role == WorkerRole.PREFILL


def role_changes(workers: Sequence[WorkerState], plan: Plan) -> RoleChanges:
    """The switches and replica counts that turn `workers` into `plan`'s pools."""
    dedicated_p = sum(1 for w in workers if not w.switchable and in_prefill(w.role))
    dedicated_d = sum(1 for w in workers if not w.switchable and not in_prefill(w.role))
    flexible = sorted((w for w in workers if w.switchable),
                      key=lambda w: (w.running, w.worker_id))
    keep_p, keep_d = min(dedicated_p, plan.prefill), min(dedicated_d, plan.decode)
    if not flexible:  # nothing switchable: the dedicated pools grow to the plan
        keep_p, keep_d = plan.prefill, plan.decode
    need_p, need_d = plan.prefill - keep_p, plan.decode - keep_d  # from switchable workers
    as_p = [w for w in flexible if in_prefill(w.role)]
    as_d = [w for w in flexible if not in_prefill(w.role)]
    switches: list[tuple[str, WorkerRole]] = []
    if need_p > len(as_p) and len(as_d) > need_d:  # decode-pool workers take prefill work
        for w in as_d[:min(need_p - len(as_p), len(as_d) - need_d)]:
            switches.append((w.worker_id, WorkerRole.PREFILL))
    elif need_d > len(as_d) and len(as_p) > need_p:  # and back
        for w in as_p[:min(need_d - len(as_d), len(as_p) - need_p)]:
            switches.append((w.worker_id, WorkerRole.BOTH))
    return RoleChanges(tuple(switches), need_p + need_d, keep_p, keep_d)


__all__ = ["RoleChanges", "RoleSwitch", "WorkerState", "role_changes"]
