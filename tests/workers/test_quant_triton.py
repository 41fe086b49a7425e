"""The Triton kernels for quantized weights (GPU code) against dequantize-then-matmul, in
Triton's CPU interpreter when there is no GPU; shapes stay small and ragged (masked edges)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton reads it at @jit
pytest.importorskip("triton", reason="the Triton quantized kernels need the triton package")

from workers.kernels.quant_triton import fp8_gemm, int4_gemm, pack_int4_pairs  # noqa: E402
from workers.quant.weights import Fp8Weight, IntWeight, expand_fp8_scales, quantize_fp8  # noqa: E402
from workers.quant.weights import quantize_int  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m, n, k, block", [(5, 40, 64, (32, 32)), (3, 33, 96, None),
                                            (17, 64, 128, (64, 64))])
def test_fp8_matches_dequantize_then_matmul(m, n, k, block):
    torch.manual_seed(m + n + k)
    w, scales = quantize_fp8(torch.randn(n, k), block)
    weight = Fp8Weight(w, expand_fp8_scales(scales, n, k, block))
    x = torch.randn(m, k)
    want = x @ weight.dequantize().t()
    got = fp8_gemm(x.to(DEVICE), weight.w.to(DEVICE), weight.scales.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m, n, k, group, symmetric", [(5, 40, 64, 32, True),
                                                       (2, 33, 128, 64, False)])
def test_int4_matches_dequantize_then_matmul(m, n, k, group, symmetric):
    torch.manual_seed(m + n + k)
    weight: IntWeight = quantize_int(torch.randn(n, k), 4, group, symmetric)
    x = torch.randn(m, k)
    want = x @ weight.dequantize().t()
    got = int4_gemm(x.to(DEVICE), pack_int4_pairs(weight.q).to(DEVICE),
                    weight.scales.to(DEVICE), weight.zeros.to(DEVICE)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
