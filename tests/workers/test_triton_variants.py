"""No decode-kernel compile while serving: every split count the planner can pick launches the
merge kernel as one compiled variant, and the split kernel as one of two (split, or the
unsplit direct write), which `CudaGraphExecutor.warm_up` compiles at start. Checked by recording
each launch's specialisation key as Triton forms it (constexpr values, tensor dtypes and 16-byte
alignment, integers that are 1 or multiples of 16 unless `do_not_specialize`d, as
`test_triton_specialization.py` checks they are) with the kernels replaced by recorders, so no
kernel runs."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # before the kernels are imported: triton reads it when @triton.jit decorates
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton attention kernels need the triton package")

from tests.workers.test_triton_specialization import PER_STEP
from workers.attention import triton_decode
from workers.attention.decode_splits import MAX_SPLITS, choose_num_splits


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch's key."""

    def __init__(self, kernel: object) -> None:
        self.names = kernel.arg_names
        self.per_step = PER_STEP[kernel.fn.__name__]
        self.keys: list[tuple] = []

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        key = []
        for name, value in zip(self.names, args):
            if isinstance(value, torch.Tensor):
                key.append((name, value.dtype, value.data_ptr() % 16 == 0))
            elif isinstance(value, int) and name not in self.per_step:
                key.append((name, value == 1, value % 16 == 0))
        key.extend(sorted((k, v) for k, v in kwargs.items() if k not in ("num_warps",)))
        self.keys.append(tuple(key))


@pytest.fixture
def recorders(monkeypatch):
    split = Recorder(triton_decode._decode_split_kernel)
    merge = Recorder(triton_decode._merge_splits_kernel)
    monkeypatch.setattr(triton_decode, "_decode_split_kernel", split)
    monkeypatch.setattr(triton_decode, "_merge_splits_kernel", merge)
    return split, merge


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_planned_split_count_reuses_the_same_variants(recorders, dtype):
    split, merge = recorders
    heads, kv_heads, dim, block_size = 8, 2, 64, 16
    cache = torch.zeros(2, 4, block_size, kv_heads, dim, dtype=dtype)
    planned = sorted({choose_num_splits(batch, kv_heads, length, 132)
                      for batch in range(1, 70) for length in (1, 300, 1000, 5000, 1 << 17)})
    assert planned == [1, 2, 4, 8, 16]  # the planner's range is covered
    for batch in (1, 3, 8):
        for num_splits in [*planned, 3]:  # 3: a count only an explicit caller passes
            q = torch.zeros(batch, heads, dim, dtype=dtype)
            tables = torch.zeros(batch, 5, dtype=torch.int32)
            lens = torch.ones(batch, dtype=torch.int32)
            triton_decode.paged_decode_attention(q, cache, tables, lens, 0.125, num_splits)
    assert len(set(merge.keys)) == 1  # every split count > 1, every batch: one merge variant
    assert len(set(split.keys)) == 2  # split partials (fp32, lse) or the output itself
    assert all(dict(k)["SPLITS"] == MAX_SPLITS for k in [tuple(
        kv for kv in key if len(kv) == 2) for key in merge.keys])


def test_a_split_count_past_the_planner_gets_a_wide_enough_merge():
    assert triton_decode.merge_width(1) == MAX_SPLITS
    assert triton_decode.merge_width(MAX_SPLITS) == MAX_SPLITS
    assert triton_decode.merge_width(MAX_SPLITS + 1) == 2 * MAX_SPLITS
