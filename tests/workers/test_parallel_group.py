"""A worker group never hangs its driver: a rank that dies, fails or goes silent is reported
by rank, and the whole group is stopped (no process left behind)."""

from __future__ import annotations

import os
import time

import pytest

from workers.engine.parallel.group import RankGroup, RankGroupError, SpawnLauncher
from workers.engine.parallel.messages import Ready, StepMessage
from workers.engine.parallel.rank import rank_main
from workers.engine.parallel.rank_setup import RankSetup

pytestmark = pytest.mark.usefixtures("spawned_ranks")  # the real spawn, as users get it

STEP = StepMessage(1, (1,), (0,), (0,), (0, 1), (1,), ((0,),), 1, (0,))


def ready_then_exit(rank: int, conn) -> None:
    conn.send(Ready(rank))
    conn.recv()
    os._exit(3)


def ready_then_silent(rank: int, conn) -> None:
    conn.send(Ready(rank))
    conn.recv()
    time.sleep(60)


def healthy_or_exit(rank: int, conn) -> None:
    """Rank 0 takes its first step and waits for its shutdown (as a healthy rank waits for its
    peers); rank 1 dies at its first step. (Rank 0 used to return after the step, exiting with
    code 0 as rank 1 exited with 3, and the group named whichever exit it saw first.)"""
    if rank == 1:
        ready_then_exit(rank, conn)
    conn.send(Ready(rank))
    conn.recv()  # the step
    try:
        conn.recv()  # Shutdown, or the driver's end closing
    except EOFError:
        pass


def test_a_rank_that_dies_mid_step_fails_the_step_and_stops_the_group():
    group = RankGroup(healthy_or_exit, [0, 1], SpawnLauncher(), timeout_s=30)
    with pytest.raises(RankGroupError, match="rank 1 exited with code 3 during step 1"):
        group.step(STEP)
    assert group.closed and all(h.exitcode() is not None for h in group.handles)
    with pytest.raises(RankGroupError, match="has been stopped"):
        group.step(STEP)


def test_a_silent_rank_times_out_instead_of_hanging():
    group = RankGroup(ready_then_silent, [0], SpawnLauncher(), timeout_s=1.0, start_timeout_s=60)
    start = time.monotonic()
    with pytest.raises(RankGroupError, match=r"ranks \[0\] did not answer step 1 within 1.0 s"):
        group.step(STEP)
    assert time.monotonic() - start < 15
    assert group.handles[0].exitcode() is not None  # killed, not leaked


def test_a_rank_that_cannot_load_its_shard_reports_why(tmp_path):
    setup = RankSetup(rank=0, tp_size=1, pp_size=1, expert_parallel=False,
                      init_method=f"file://{tmp_path / 'rendezvous'}", model=str(tmp_path),
                      dtype="float32", load_format="auto", seed=0, attention_backend="torch",
                      kv_caches=(), timeout_s=30, device="cpu")
    with pytest.raises(RankGroupError, match="rank 0 failed during start-up: FileNotFoundError: no config.json"):
        RankGroup(rank_main, [setup], SpawnLauncher(), timeout_s=60)
