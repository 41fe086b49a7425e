"""`cleave role`: switch one worker of a running deployment to another role in place.

Only a worker started as "both" (the aggregated pool's) switches: it stays a replica of its
pool's Serve deployment, and its role is the routers' to assign (`router.role_switch`). To
prefill, its running streams first move to the other decode-capable workers with their KV (live
migration: nothing recomputed, no stream dropped); back to "aggregated" (or to "decode"), it
first finishes the prompts it holds. Its cached prefixes stay, useful under either role. One
router replica switches it and records the role in the `Directory`; the others follow at their
next sync, each moving its own streams. Refused while the SLO planner runs (it owns the roles of
the switchable workers: `router.slo_control`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from cluster.drain import app_handles

ROLES = {"prefill": "prefill", "decode": "decode", "aggregated": "both"}


def switch_worker_role(worker_id: str, role: str, address: str | None = None,
                       timeout_s: float = 120.0) -> dict[str, Any]:
    """Switch `worker_id` to `role` ("prefill", "decode" or "aggregated"); the switch done:
    the worker, its role before and after, the streams moved and the seconds it took. Raises
    `ValueError` for a worker that is not there, was not started as "both", or a role that is
    not one of those, or while the SLO planner owns the roles."""
    if role not in ROLES:
        raise ValueError(f"no role {role!r}; expected one of {sorted(ROLES)}")
    directory, router = app_handles(address)
    entries = directory.entries.remote().result(timeout_s=30)
    entry = next((e for e in entries if e.worker_id == worker_id), None)
    if entry is None:
        raise ValueError(f"no worker {worker_id!r}; expected one of "
                         f"{[e.worker_id for e in entries]}")
    if entry.role != "both":
        raise ValueError(f"worker {worker_id!r} was started as {entry.role!r} (pool "
                         f"{entry.pool!r}); only a worker of the aggregated pool switches role")
    try:
        switch = router.switch_role.remote(worker_id, ROLES[role]).result(timeout_s=timeout_s)
    except ValueError as exc:  # raised in the router replica: its own message, not the trace
        raise ValueError(str(getattr(exc, "cause", exc))) from None
    return {"worker_id": switch.worker_id, "before": _name(switch.before.value),
            "after": _name(switch.after.value), "streams_moved": switch.moved,
            "seconds": round(switch.seconds, 6)}


def _name(role: str) -> str:
    return "aggregated" if role == "both" else role


def _cmd_role(args: argparse.Namespace) -> int:
    done = switch_worker_role(args.worker_id, args.role, args.address, args.timeout)
    print(json.dumps(done))
    print(f"{done['worker_id']}: {done['before']} -> {done['after']} in {done['seconds']} s, "
          f"{done['streams_moved']} streams moved", file=sys.stderr)
    return 0


def add_role_parser(sub: argparse._SubParsersAction) -> None:
    role = sub.add_parser("role", help=(
        "switch a worker of the aggregated pool to prefill, decode or back to aggregated in "
        "place: its running streams move to the others with their KV first"))
    role.add_argument("worker_id", help="the worker to switch (`cleave status` lists them)")
    role.add_argument("role", choices=sorted(ROLES), help="the role it is routed under next")
    role.add_argument("--timeout", type=float, default=120.0,
                      help="seconds to wait for the switch (its streams to move)")
    role.add_argument("--address", default=None,
                      help="the Ray cluster (default: RAY_ADDRESS, else the local one)")
    role.set_defaults(func=_cmd_role)


__all__ = ["add_role_parser", "switch_worker_role"]
