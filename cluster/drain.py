"""`cleave drain`: restart one worker of a running deployment without losing its work.

The worker is marked draining in the `Directory`; every router replica then routes it nothing
new, moves its running streams to the other workers of its pool with their KV (live migration:
nothing recomputed, no token repeated or lost) and hands its hottest prefixes to them
(`router.hand_off`). Once it holds no request and no lease, its engine is marked broken, so
Serve replaces the replica with a fresh one (a planned restart: a new engine, a new worker id).
Without a worker id, the coldest worker of `--pool` goes: the one whose cache served the
fewest blocks lately, per block it has.
"""

from __future__ import annotations

import os
import time
from typing import Any
from collections.abc import Callable

from cluster.directory import TTL_S
from cluster.launch import APP_NAME
from router.hand_off import cache_worth

POLL_S = 0.25
ROUTER_SYNC_S = 1.0  # router replicas read the directory every kv_poll_interval_s (0.5 s)


def _check_time(worker_id: str, started: float, timeout_s: float, waiting_for: str) -> None:
    if time.monotonic() - started > timeout_s:
        raise TimeoutError(f"draining {worker_id}: still waiting for {waiting_for} after "
                           f"{timeout_s:.0f}s")


def app_handles(address: str | None) -> tuple[Any, Any]:
    """The directory's and the router's deployment handles."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto",
                 log_to_driver=False)
    if APP_NAME not in serve.status().applications:
        raise ValueError(f"no Cleave application ({APP_NAME!r}) is running on this Ray cluster")
    return (serve.get_deployment_handle("directory", app_name=APP_NAME),
            serve.get_deployment_handle("router", app_name=APP_NAME))


def _stats(entry: Any) -> Any | None:
    """The worker's `EngineStats`, or None when its engine actor is gone (its replica died:
    the directory drops it within `TTL_S` of its last heartbeat)."""
    import ray

    try:
        return ray.get(entry.actor.stats.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return None


def _choose(entries: list[Any], worker_id: str | None, pool: str) -> tuple[Any, Any]:
    """The worker to drain and its stats: `worker_id`, or the coldest that answers of
    `pool`."""
    if worker_id is not None:
        entry = next((e for e in entries if e.worker_id == worker_id), None)
        if entry is None:
            raise ValueError(f"no worker {worker_id!r}; expected one of "
                             f"{[e.worker_id for e in entries]}")
        stats = _stats(entry)
        if stats is None:
            raise ValueError(f"worker {worker_id!r} does not answer: its replica died (the "
                             f"directory drops it within {TTL_S:.0f} s); nothing to drain")
        return entry, stats
    answering = [(e, s) for e in entries if not e.draining and e.pool == pool
                 for s in [_stats(e)] if s is not None]
    if len(answering) < 2:
        raise ValueError(f"pool {pool!r} has {len(answering)} live workers; a drain needs "
                         "another to take its streams (name the worker to drain it anyway)")
    return min(answering, key=lambda es: cache_worth(es[1]))


def drain_worker(worker_id: str | None = None, pool: str = "decode",
                 address: str | None = None, timeout_s: float = 300.0,
                 progress: Callable[[str], None] | None = None, *, with_kv: bool = True,
                 restart: bool = True) -> dict[str, Any]:
    """Drain and restart one worker (see the module); what happened. Raises `ValueError` for
    a worker or pool that is not there, `TimeoutError` when its requests outlive `timeout_s`
    (they fail over to the others when Serve then removes it). `with_kv` False: the streams
    are recomputed on the other workers instead (replay, the benchmarks' baseline);
    `restart` False: the worker stays, drained, routed nothing (benchmarks)."""
    import ray

    directory, router = app_handles(address)
    entries = directory.entries.remote().result(timeout_s=30)
    entry, before = _choose(entries, worker_id, pool)
    say = progress or (lambda line: None)
    directory.set_draining.remote(entry.worker_id, with_kv).result(timeout_s=30)
    say(f"draining {entry.worker_id} ({entry.pool}): {before.num_running} running, "
        f"{before.num_waiting} waiting")
    if not any(e.pool == entry.pool and not e.draining and e.worker_id != entry.worker_id
               for e in entries):
        say(f"{entry.worker_id} is the only live worker of pool {entry.pool!r}: its streams "
            "finish where they are, and the pool takes no request until Serve replaces it")
    started = time.monotonic()
    while not router.drained.remote(entry.worker_id).result(timeout_s=30):  # one replica's
        _check_time(entry.worker_id, started, timeout_s, "routers to move its streams")
        time.sleep(POLL_S)
    time.sleep(ROUTER_SYNC_S)  # the other router replicas, a sync later at most
    while True:
        in_flight = ray.get(entry.actor.num_in_flight.remote(), timeout=30)
        leases = ray.get(entry.actor.resources.remote(), timeout=30)["leases"]
        if not in_flight and not leases:
            break
        _check_time(entry.worker_id, started, timeout_s,
                    f"{in_flight} requests and {leases} leases to end")
        time.sleep(POLL_S)
    drained_s = time.monotonic() - started
    if restart:
        say(f"{entry.worker_id} holds nothing after {drained_s:.1f}s; restarting it")
        entry.actor.mark_broken.remote("a planned restart (cleave drain)")
    return {"worker_id": entry.worker_id, "pool": entry.pool, "drained_s": round(drained_s, 3),
            "num_running_before": before.num_running, "num_waiting_before": before.num_waiting}
