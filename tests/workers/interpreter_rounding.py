"""Triton 3.9's interpreter truncates fp32 -> bf16 casts where GPUs round to nearest even; the
fixture here makes its casts round (torch's conversion), so bf16 results of kernels run in the
interpreter compare with the torch reference as they would on a GPU. Use it in a module with
`pytestmark = pytest.mark.usefixtures("rounding_bf16_as_gpus_do")` after importing it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def rounding_bf16_as_gpus_do(monkeypatch):
    if torch.cuda.is_available():
        return  # compiled kernels round correctly
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    real = InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return real(self, src, dst_type)

    monkeypatch.setattr(InterpreterBuilder, "cast_impl", cast_impl)
