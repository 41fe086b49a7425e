"""No Triton compile while serving: the integer arguments that change from step to step (split
count, block-table width, scratch strides, window) are not specialised on, so a new value never
compiles a variant. Checked on the compiled kernels' parameters, outside the interpreter (which
keeps no specialisation), in a fresh process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

# not imported here: importing triton before a test module sets TRITON_INTERPRET breaks those
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the kernels need the triton package")

CHECK = """
from workers.attention import triton_decode as d, triton_prefill as p
for kernel in (d._decode_split_kernel, d._merge_splits_kernel, p._prefill_kernel):
    print(kernel.fn.__name__, *sorted(q.name for q in kernel.params if q.do_not_specialize))
"""

PER_STEP = {
    "_decode_split_kernel": {"num_splits", "window", "stride_table_seq", "stride_out_seq",
                             "stride_out_head", "stride_out_split", "stride_lse_seq",
                             "stride_lse_head"},
    "_merge_splits_kernel": {"num_splits", "stride_part_seq", "stride_part_head",
                             "stride_part_split", "stride_lse_seq", "stride_lse_head",
                             "stride_out_seq", "stride_out_head"},
    "_prefill_kernel": {"window", "stride_table_seq"},
}


def test_per_step_integers_are_not_specialised_on():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__))))).stdout
    found = {line.split()[0]: set(line.split()[1:]) for line in out.splitlines()}
    assert found == PER_STEP
