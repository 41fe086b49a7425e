"""The CPU int8/int4 kernels (`workers/kernels/csrc/int_gemm.c`) called directly: they equal a
dequantize-then-matmul reference, read bf16 rows and write bf16 results with the same bits as
the fp32 path followed by torch's cast, and give the same bits on one thread as on two."""

from __future__ import annotations

import pytest
import torch

from workers.kernels import int_gemm as int_kernels

pytestmark = pytest.mark.skipif(not int_kernels.available(),
                                reason="the int8/int4 kernels need AVX-512 VNNI")
N, K, GROUP = 202, 256, 64  # N not a multiple of the 4-row tiles: a padded last tile


def int4_weight(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=g)
    scales = torch.rand(N, K // GROUP, generator=g) * 0.01 + 1e-3
    zeros = torch.randint(-2, 3, (N, K // GROUP), generator=g).float()
    w = (q.float() - zeros.repeat_interleave(GROUP, 1)) * scales.repeat_interleave(GROUP, 1)
    return int_kernels.block_int4(q, scales, zeros), w


def int8_weight(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scales = torch.rand(N, generator=g) * 0.01 + 1e-3
    return int_kernels.block_int8(q), scales, q.float() * scales[:, None]


def int4(x, out_dtype=torch.float32, num_threads=None):
    blocked, _ = int4_weight()
    return int_kernels.int4_gemm(x, blocked, N, GROUP, num_threads, out_dtype=out_dtype)


def int8(x, out_dtype=torch.float32, num_threads=None):
    blocked, scales, _ = int8_weight()
    return int_kernels.int8_gemm(x, blocked, scales, num_threads, out_dtype=out_dtype)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_both_kernels_match_the_dequantized_matmul(rows):
    x = torch.randn(rows, K)
    for got, w in ((int4(x), int4_weight()[1]), (int8(x), int8_weight()[2])):
        want = x @ w.t()
        assert (got - want).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.parametrize("kernel", [int4, int8])
@pytest.mark.parametrize("rows", [1, 5])
def test_bf16_rows_in_and_out_have_the_bits_of_the_fp32_path_and_a_cast(kernel, rows):
    x = torch.randn(rows, K, dtype=torch.bfloat16)
    fp32 = kernel(x.float())
    assert torch.equal(kernel(x), fp32)
    assert torch.equal(kernel(x, torch.bfloat16), fp32.to(torch.bfloat16))
    assert torch.equal(kernel(x.float(), torch.bfloat16), fp32.to(torch.bfloat16))


@pytest.mark.parametrize("kernel", [int4, int8])
def test_one_thread_and_two_give_the_same_bits(kernel):
    x = torch.randn(3, K, dtype=torch.bfloat16)
    assert torch.equal(kernel(x, torch.bfloat16, 1), kernel(x, torch.bfloat16, 2))


def test_symmetric_int4_weights_carry_no_offsets_and_agree_with_explicit_ones():
    """Without offsets the kernel subtracts 8 * sum(x) from each block's integer dot products
    (exact); with them, a float correction per group: the same sums up to fp32 rounding."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=g)
    scales = torch.rand(N, K // GROUP, generator=g) * 0.01 + 1e-3
    packed, block_scales, offsets = int_kernels.block_int4(q, scales, torch.zeros_like(scales))
    assert offsets is None
    explicit = (packed, block_scales, 8 * block_scales)  # (8 + 0) * scale, as block_int4 made
    for rows in (1, 3, 8):
        x = torch.randn(rows, K, dtype=torch.bfloat16, generator=g)
        sym = int_kernels.int4_gemm(x, (packed, block_scales, None), N, GROUP)
        torch.testing.assert_close(sym, int_kernels.int4_gemm(x, explicit, N, GROUP),
                                   rtol=1e-5, atol=1e-5 * sym.abs().max().item())


def test_bf16_scales_are_kept_in_bf16_and_give_the_bits_of_fp32_ones():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, (N, K), dtype=torch.int8, generator=g)
    scales = (torch.rand(N, K // GROUP, generator=g) * 0.01 + 1e-3).to(torch.bfloat16).float()
    zeros = torch.randint(-2, 3, (N, K // GROUP), generator=g).float()
    packed, block_scales, offsets = int_kernels.block_int4(q, scales, zeros)
    assert block_scales.dtype == torch.bfloat16  # as compressed-tensors stores them
    x = torch.randn(3, K, dtype=torch.bfloat16)
    assert torch.equal(
        int_kernels.int4_gemm(x, (packed, block_scales, offsets), N, GROUP),
        int_kernels.int4_gemm(x, (packed, block_scales.float(), offsets), N, GROUP))
