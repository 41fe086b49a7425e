"""GPU matmuls for quantized weights, in Triton: FP8 e4m3 with a scale per output row and block
of input columns (DeepSeek-V3's 128 x 128 blocks expanded to rows, per-tensor and per-channel
scales as one block), and int4 weight-only in groups with zero points.

Each kernel computes one [BLOCK_M, BLOCK_N] tile of y = x W^T in fp32: the weight tile is
loaded in its stored form (one byte, or half a byte, per value: what decode reads from memory),
widened and scaled in registers, and multiplied with `tl.dot` in fp32 ("ieee": the default tf32
keeps 10 mantissa bits, errors of 1e-3 where the tests ask 1e-4). Tested against a
dequantize-then-matmul reference in Triton's CPU interpreter (`TRITON_INTERPRET=1`) and, where
there is a GPU, compiled. Not chosen by the loader, which dequantizes quantized weights at load
on a GPU: on an H200 (Llama-3-8B's projections, 1 to 128 rows) they take 8x to 100x the time
of torch's bf16 matmul (`benchmarks/results/gpu_quant_gemm.json`; 1.7x to 14x with tf32 dots):
16 x 32 tiles with K steps of 32 and fp32 dots are far from the memory bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, num_scale_cols, block_cols,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :],
                    mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0).to(tl.float32)
        # BLOCK_K divides the scale blocks: one scale per output row in this K tile
        s = tl.load(s_ptr + cols * num_scale_cols + k0 // block_cols, mask=cols < N, other=0.0)
        acc += tl.dot(x, tl.trans(w * s[:, None]), input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] times FP8 w [N, K] with scales [N, ceil(K / block)] fp32 -> [M, N] fp32."""
    m, k = x.shape
    n = w.shape[0]
    block_cols = -(-k // scales.shape[1])
    block_k = min(32, block_cols)
    if block_cols % block_k:
        raise ValueError(f"fp8_gemm: scale blocks of {block_cols} columns are not a multiple "
                         f"of {block_k}")
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 32))
    _fp8_gemm_kernel[grid](x.contiguous(), w.contiguous(), scales.contiguous(), y, m, n, k,
                           scales.shape[1], block_cols, BLOCK_M=16, BLOCK_N=32,
                           BLOCK_K=block_k)
    return y


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, group,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_K: tl.constexpr):
    """w: [N, K / 2] bytes, column 2i in the low nibble of byte i, 2i + 1 in the high one,
    unsigned (value + 8); scales and zeros [N, K / group]; HALF_K bytes per step (2 HALF_K
    columns, within one group)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    groups = K // group
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, K // 2, HALF_K):
        bs = b0 + tl.arange(0, HALF_K)
        packed = tl.load(w_ptr + cols[:, None] * (K // 2) + bs[None, :],
                         mask=cols[:, None] < N, other=0).to(tl.int32)
        g = (2 * b0) // group
        s = tl.load(s_ptr + cols * groups + g, mask=cols < N, other=0.0)
        z = tl.load(z_ptr + cols * groups + g, mask=cols < N, other=0.0)
        lo = ((packed & 15).to(tl.float32) - 8.0 - z[:, None]) * s[:, None]
        hi = (((packed >> 4) & 15).to(tl.float32) - 8.0 - z[:, None]) * s[:, None]
        w = tl.interleave(lo, hi)  # [BLOCK_N, 2 HALF_K]: columns in order
        ks = 2 * b0 + tl.arange(0, 2 * HALF_K)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < M,
                    other=0.0).to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 q [N, K] -> uint8 [N, K / 2]: byte i = (q[2i] + 8) | (q[2i + 1] + 8) << 4."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] times int4 weights `pack_int4_pairs` packed, w = (q - z) s per group ([N, G]
    fp32 scales and integer-valued zeros) -> [M, N] fp32. The group is at least 32 columns."""
    m, k = x.shape
    n = packed.shape[0]
    group = k // scales.shape[1]
    if group % 32 or k % group:
        raise ValueError(f"int4_gemm takes groups of a multiple of 32 columns dividing K, got "
                         f"{group} for K={k}")
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 32))
    _int4_gemm_kernel[grid](x.contiguous(), packed.contiguous(), scales.contiguous(),
                            zeros.contiguous(), y, m, n, k, group, BLOCK_M=16, BLOCK_N=32,
                            HALF_K=16)
    return y
