"""KV caches on the host: zeroed, and advised onto huge pages where Linux allows."""

from __future__ import annotations

import sys

import pytest
import torch

from workers.engine.kv_cache.host_memory import advise_huge_pages, zeros


def test_zeros_are_zero_with_the_asked_shape_and_dtype():
    t = zeros((2, 64, 16, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (2, 64, 16, 2, 8) and t.dtype == torch.bfloat16
    assert not t.any()


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_the_kernel_accepts_the_huge_page_advice_for_a_large_cache():
    t = torch.empty(8 * 1024 * 1024, dtype=torch.uint8)  # 8 MiB: several huge pages
    assert advise_huge_pages(t)
    assert not advise_huge_pages(torch.empty(0))  # no whole page to advise


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_a_cache_takes_memory_only_where_it_is_written():
    """A server's cache sized to its memory costs nothing at start: the pages are committed
    as blocks are first written (the tiny model's default cache is 512 MiB)."""
    before = resident_mib()
    t = zeros((2, 4096, 16, 16, 64), torch.float32, torch.device("cpu"))  # 512 MiB
    assert resident_mib() - before < 64
    t[:, :2048].fill_(1.0)  # half the blocks written
    assert resident_mib() - before > 200
    assert float(t[:, 2048:].abs().sum()) == 0.0 and float(t[:, :2048].sum()) == t[:, :2048].numel()
