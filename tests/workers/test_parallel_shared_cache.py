"""A worker group's KV caches in one shared-memory file: zeroed, shared with whoever maps the
descriptors, and gone from /dev/shm once unlinked (started group or failed one)."""

from __future__ import annotations

import glob
import mmap
import os
import pickle

import pytest
import torch

from workers.engine.kv_cache.spec import KVCacheSpec

from workers.engine.parallel.shared_cache import FILE_PREFIX, SHM_DIR, SharedCaches, map_tensors

SHAPE = (2, 8, 4, 2, 8)  # [2, num_blocks, block_size, heads, head_dim]


def cache_files() -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}{os.getpid()}-*"))


def test_caches_are_zeroed_page_aligned_and_shared_through_their_descriptors():
    caches = SharedCaches(3, SHAPE, torch.bfloat16)
    try:
        assert [t.shape for t in caches.tensors] == [SHAPE] * 3
        assert all(t.dtype == torch.bfloat16 and not t.any() for t in caches.tensors)
        assert all(t.data_ptr() % mmap.PAGESIZE == 0 for t in caches.tensors)
        refs = pickle.loads(pickle.dumps(caches.refs[1:]))  # what a rank receives
        mine = map_tensors(refs)  # a mapping of its own, as in another process
        mine[0][1, 3, 2] = 7.0
        caches.tensors[2][0, 0, 0] = 5.0
    finally:
        caches.unlink()
    assert not cache_files()
    assert caches.tensors[1][1, 3, 2].eq(7.0).all() and mine[1][0, 0, 0].eq(5.0).all()
    assert not caches.tensors[0].any()  # neighbours untouched
    with pytest.raises(FileNotFoundError):  # unlinked: too late to map, and nothing created
        map_tensors(refs)
    assert not cache_files()


def test_a_group_that_fails_to_start_leaves_no_cache_file(tmp_path):
    from workers.engine.parallel.executor import GroupExecutor, GroupOptions
    from workers.engine.parallel.group import RankGroupError

    options = GroupOptions(tp_size=1, pp_size=1, expert_parallel=False, model=str(tmp_path),
                           dtype="float32", load_format="auto", seed=0,
                           attention_backend="torch", timeout_s=60, device="cpu")
    with pytest.raises(RankGroupError, match="no config.json"):
        GroupExecutor(options, KVCacheSpec(num_layers=2, num_blocks=8, block_size=4,
                                           num_kv_heads=2, head_dim=8, dtype=torch.float32))
    assert not cache_files()
