"""Workers pinned to cores of their own (`cluster.cpu_affinity`): claims exclusive across
processes and freed when their holder dies; every thread of the pinned process moved."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from cluster.config import CleaveConfig
from cluster.cpu_affinity import CoreClaimError, affinity_of, claim_cores, pin_process

CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(autouse=True)
def claim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CLEAVE_CPU_CLAIM_DIR", str(tmp_path / "claims"))


def _hold(cores: list[int], count: int, ready, done) -> None:  # noqa: ANN001 - mp events
    claim_cores(cores, count)
    ready.set()
    done.wait(30)


def test_a_core_is_held_by_one_process_until_it_ends():
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=([CORES[0]], 1, ready, done))
    holder.start()
    try:
        assert ready.wait(60)
        with pytest.raises(CoreClaimError, match=rf"cpu_affinity=\[{CORES[0]}\].*held by "
                                                 r"other workers"):
            claim_cores([CORES[0]], 1)
        if len(CORES) > 1:  # the next core of the list is still free
            assert claim_cores(CORES[:2], 1).cores == (CORES[1],)
    finally:
        done.set()
        holder.join(30)
    claim = claim_cores([CORES[0]], 1)  # the holder died: its core is free at once
    assert claim.cores == (CORES[0],)
    claim.release()
    assert claim_cores([CORES[0]], 1).cores == (CORES[0],)


def test_a_core_this_machine_lacks_is_named():
    with pytest.raises(CoreClaimError, match=r"names cores \[4096\]"):
        claim_cores([CORES[0], 4096], 1)


def _pin_and_report(cores: list[int], queue) -> None:  # noqa: ANN001 - an mp queue
    import torch

    stop = threading.Event()
    early = threading.Thread(target=stop.wait, daemon=True)  # a thread already running
    early.start()
    pin_process(cores)
    late = threading.Thread(target=stop.wait, daemon=True)  # and one started after
    late.start()
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    queue.put(({tid: affinity_of(tid) for tid in tids}, torch.get_num_threads()))
    stop.set()


def test_pinning_moves_every_thread_and_sets_torch_threads():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_pin_and_report, args=([CORES[-1]], queue))
    child.start()
    masks, threads = queue.get(timeout=60)
    child.join(30)
    assert len(masks) >= 3
    assert set(masks.values()) == {(CORES[-1],)}
    assert threads == 1


def test_the_config_refuses_bad_core_lists():
    for bad in ([], [-1], [0, 0]):
        with pytest.raises(ValueError, match="cpu_affinity"):
            CleaveConfig.parse({"pools": {"decode": {"cpu_affinity": bad}}})
    with pytest.raises(ValueError, match=r"fewer cores than one rank reserves"):
        CleaveConfig.parse({"pools": {"decode": {"cpu_affinity": [0], "cpus_per_rank": 2}}})
    config = CleaveConfig.parse({"pools": {"decode": {"cpu_affinity": [1, 0]}},
                                 "router": {"cpu_affinity": [0]}})
    assert config.pools.decode.cpu_affinity == [1, 0]
