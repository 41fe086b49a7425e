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
