"""Switching a worker's role in place (the planner's actuator, `router.role_plan`, decides
which). Torch-free.

A worker started as "both" runs either half, so its role is the router's to assign
(`WorkerSet.assign_role`): switchable workers are one Serve deployment, and a switch costs no
replica start. Before the switch the worker is emptied of what its new role must not run:

- to PREFILL: drained (routed nothing new) while its running streams move to other
  decode-pool workers with their KV (`LiveMigrations.drain`: nothing recomputed, no stream
  dropped); a request still queued or in its prefill there moves at its first token
  (`LiveMigrations.track`).
- back to the decode pool: routed nothing new until the prompts queued or prefilling there
  are done (as it reports them), so no long prefill chunk stalls the streams it will take; at
  most `PREFILLS_WAIT_S`.

Its cached prefixes stay where they are and in the prefix index, useful under either role.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.live_migration import LiveMigrations
from router.role_plan import RoleSwitch
from router.workers import WorkerSet
from workers.contract.protocol import WorkerRole

logger = logging.getLogger(__name__)

PREFILLS_WAIT_S = 30.0
POLL_S = 0.01


async def switch_role(workers: WorkerSet, migrations: LiveMigrations, worker_id: str,
                      role: WorkerRole) -> RoleSwitch:
    """Route `worker_id` (started as "both") under `role` once emptied (see the module).
    Raises `ValueError` for a worker started for one half."""
    started = time.monotonic()
    before = workers.role_of(worker_id)
    if role == before:
        return RoleSwitch(worker_id, before, role, 0, 0.0)
    own = workers.info(worker_id).role
    if own != WorkerRole.BOTH:
        raise ValueError(f"worker {worker_id!r} was started as {own.value!r}; only a worker "
                         f"started as 'both' switches role")
    moved = 0
    try:
        if role == WorkerRole.PREFILL:
            moved = await migrations.drain(worker_id, with_kv=True)
        else:
            workers.draining.add(worker_id)
            await _prefills_done(workers, worker_id)
        workers.assign_role(worker_id, role)
    finally:
        migrations.end_drain(worker_id)
    switch = RoleSwitch(worker_id, before, role, moved, time.monotonic() - started)
    logger.info("worker %s switched from %s to %s in %.3f s (%d streams moved)", worker_id,
                before.value, role.value, switch.seconds, moved)
    return switch


async def _prefills_done(workers: WorkerSet, worker_id: str) -> None:
    """Until the worker reports no prompt queued, prefilling or handed off but held there."""
    deadline = time.monotonic() + PREFILLS_WAIT_S
    while time.monotonic() < deadline:
        stats = workers.stats(worker_id)
        if stats is None or (stats.num_waiting == 0 and stats.num_running == 0
                             and stats.num_pending_prompt_tokens == 0):
            return
        await asyncio.sleep(POLL_S)
    logger.warning("worker %s still has prompts after %.0f s; switching it anyway", worker_id,
                   PREFILLS_WAIT_S)


__all__ = ["switch_role"]
