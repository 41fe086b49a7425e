"""A GPU worker group sizes its KV cache the way one GPU does, but on every rank: each loads its
shard, runs the largest step with the group and reports its memory; the cache gets the blocks
the tightest rank has room for. Fake ranks report fake readings (no GPU here); a CPU group keeps
its fixed budget."""

from __future__ import annotations

import pytest
import torch

from tests.workers.test_parallel_gpu import FAVOURITE, GREEDY, FakeLauncher, options
from workers.engine.assembly import CPU_KV_CACHE_BYTES
from workers.engine.config import EngineConfig
from workers.engine.core import Engine
from workers.engine.kv_cache.spec import KVCacheSpec
from workers.engine.parallel.executor import GroupExecutor
from workers.engine.parallel.messages import AllocateCaches, MemoryReport, Shutdown, StepMessage
from workers.engine.parallel.rank_memory import KVProfile, KVSizing, group_num_blocks
from workers.contract.protocol import WorkerRequest

GIB = 2**30


def test_the_group_takes_the_fewest_blocks_any_rank_has_room_for():
    reports = [MemoryReport(0, 1000, 0, 0), MemoryReport(1, 700, 0, 0), MemoryReport(2, 90, 0, 0)]
    budget = lambda r: r.total_bytes  # noqa: E731
    # rank 1 has less memory but holds half as much of a block: rank 0 is the tightest
    assert group_num_blocks(reports[:2], budget, [100, 50]) == 10
    assert group_num_blocks(reports[:2], budget, [50, 100]) == 7
    with pytest.raises(ValueError, match="rank 2 has no GPU memory left for the KV cache: 90 "
                                         "bytes .* hold no block of 100 bytes"):
        group_num_blocks(reports, budget, [10, 10, 100])
    with pytest.raises(ValueError, match="3 memory reports for 2 ranks"):
        group_num_blocks(reports, budget, [1, 1])


def gpu_engine(model: str, launcher: FakeLauncher, **overrides: object) -> Engine:
    config = EngineConfig(model=model, device="cuda", tensor_parallel_size=2,
                          pipeline_parallel_size=2, block_size=4, gpu_memory_utilization=0.5,
                          max_num_batched_tokens=64, max_num_seqs=8, **overrides)
    return Engine(config, launcher)


def test_gpu_ranks_measure_first_and_the_cache_fits_the_tightest(tiny_model):
    # (total, peak, outside torch) per rank: the last stage's LM head, another process on GPU 3
    readings = {0: (10 * GIB, GIB, 0), 1: (10 * GIB, GIB, 0), 2: (10 * GIB, 2 * GIB, 0),
                3: (10 * GIB, 2 * GIB, GIB)}
    launcher = FakeLauncher(readings=readings)
    engine = gpu_engine(tiny_model, launcher)
    try:
        per_block = [s.kv_caches.bytes_per_block for s in launcher.setups]
        budgets = [5 * GIB - 1 * GIB, 5 * GIB - GIB, 5 * GIB - 2 * GIB, 5 * GIB - 3 * GIB]
        expected = min(b // p for b, p in zip(budgets, per_block))
        assert expected == budgets[3] // per_block[3]  # rank 3 is the tightest
        assert engine.kv.pool.num_blocks == engine.kv_cache_spec.num_blocks == expected
        # a rank's share of a block: its stage's layers, half the KV heads
        whole = engine.kv_cache_spec.bytes_per_block
        assert sum(per_block) == whole
        profile = launcher.setups[0].profile
        assert all(s.profile == profile for s in launcher.setups)
        assert isinstance(profile.step, StepMessage) and profile.step.num_tokens == 64
        for rank in launcher.ranks:
            sent = [m for m in rank.received if isinstance(m, AllocateCaches)]
            assert [m.kv_caches for m in sent] == [rank.setup.kv_caches.with_blocks(expected)]
        engine.generate(WorkerRequest("r", (1, 2, 3), GREEDY))
        assert [t for _ in range(4) for e in engine.step() for t in e.token_ids] == [FAVOURITE] * 4
    finally:
        engine.close()


def test_a_rank_without_room_fails_the_start_naming_it_and_stops_every_rank(tiny_model):
    readings = {r: (10 * GIB, GIB, 0) for r in range(4)}
    readings[2] = (10 * GIB, 5 * GIB, 0)  # nothing left of its half of 10 GiB
    launcher = FakeLauncher(readings=readings)
    with pytest.raises(ValueError, match="rank 2 has no GPU memory left for the KV cache"):
        gpu_engine(tiny_model, launcher)
    assert all(r.received == [Shutdown()] for r in launcher.ranks)


@pytest.mark.parametrize("device, overrides", [("cpu", {}), ("cuda", {"num_blocks": 24}),
                                               ("cuda", {"kv_cache_memory_bytes": 2**20})])
def test_a_cpu_group_or_a_configured_size_is_not_measured(tiny_model, device, overrides):
    launcher = FakeLauncher()
    engine = Engine(EngineConfig(model=tiny_model, device=device, tensor_parallel_size=2,
                                 **overrides), launcher)
    try:
        spec = engine.kv_cache_spec
        budget = overrides.get("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
        assert spec.num_blocks == overrides.get("num_blocks", budget // spec.bytes_per_block)
        assert all(s.profile is None and s.kv_caches.shape[1] == spec.num_blocks
                   for s in launcher.setups)
        assert not any(isinstance(m, AllocateCaches) for r in launcher.ranks for m in r.received)
    finally:
        engine.close()


def test_only_a_gpu_group_measures():
    sizing = KVSizing(KVProfile(StepMessage(0, (1,), (0,), (0,), (0, 1), (1,), ((0,),), 0, ()),
                                1), lambda r: 0)
    with pytest.raises(ValueError, match="only a GPU group sizes its KV cache by profiling"):
        GroupExecutor(options("cpu"), KVCacheSpec(2, 8, 4, 2, 16, torch.float32),
                      FakeLauncher(), sizing)
