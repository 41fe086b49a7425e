"""A quantized linear weight as Cleave holds it, whatever format it came in.

`IntWeight`: w[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g], with g = g_idx[k] (act-order) or
k // group_size. q and zeros are signed (a 4-bit value in [-8, 7]), so a symmetric scheme has
zeros 0. `Fp8Weight`: w[n, k] = fp8[n, k] * scales[n, k // block_cols]; the row dimension is
always expanded to one scale per output row, so fused projections concatenate and tensor
parallel shards split rows without caring about the checkpoint's blocks.

`quantize_int` and `quantize_fp8` are round-to-nearest, what `cleave quantize` writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass
class IntWeight:
    q: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # fp32 [N, G]
    zeros: torch.Tensor  # fp32 [N, G], integer-valued
    bits: int
    g_idx: torch.Tensor | None = None  # int64 [K]: each input column's group (act-order)

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def groups(self) -> torch.Tensor:
        """int64 [K]: the scale column of each input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.q.shape[1]) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.groups()
        w = (self.q.float() - self.zeros[:, g]) * self.scales[:, g]
        return w.to(dtype)


@dataclass
class Fp8Weight:
    w: torch.Tensor  # float8_e4m3fn [N, K]
    scales: torch.Tensor  # fp32 [N, ceil(K / block_cols)]

    @property
    def block_cols(self) -> int:
        k, groups = self.w.shape[1], self.scales.shape[1]
        return -(-k // groups)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        cols = torch.arange(self.w.shape[1]) // self.block_cols
        return (self.w.float() * self.scales[:, cols]).to(dtype)


def quantize_int(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool,
                 g_idx: torch.Tensor | None = None) -> IntWeight:
    """Round-to-nearest: w [N, K] float -> IntWeight with one scale per group of input columns
    (`group_size` None: per output channel). `g_idx` [K]: act-order groups, else contiguous."""
    n, k = w.shape
    size = group_size or k
    if k % size:
        raise ValueError(f"input size {k} is not a multiple of group_size {size}")
    groups = g_idx.long() if g_idx is not None else torch.arange(k) // size
    num_groups = k // size
    w32 = w.float()
    order = torch.argsort(groups, stable=True)
    grouped = w32[:, order].reshape(n, num_groups, size)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if symmetric:
        scales = grouped.abs().amax(-1) / hi
        zeros = torch.zeros_like(scales)
    else:
        wmin = grouped.amin(-1).clamp(max=0)
        wmax = grouped.amax(-1).clamp(min=0)
        scales = (wmax - wmin) / (hi - lo)
        zeros = torch.round(lo - wmin / scales.clamp(min=1e-12)).clamp(lo, hi)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w32 / scales[:, groups] + zeros[:, groups]).clamp(lo, hi).to(torch.int8)
    return IntWeight(q, scales, zeros, bits, g_idx.long() if g_idx is not None else None)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """Round-to-nearest FP8 e4m3: (w_fp8 [N, K], scales) with scales [ceil(N/bn), ceil(K/bk)]
    for `block` (bn, bk), else one per-tensor scale of shape []."""
    w32 = w.float()
    if block is None:
        scale = (w32.abs().amax() / FP8_MAX).clamp(min=1e-12)
        return (w32 / scale).to(FP8), scale
    bn, bk = block
    n, k = w32.shape
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    padded = torch.nn.functional.pad(w32, (0, pk - k, 0, pn - n))
    blocks = padded.reshape(pn // bn, bn, pk // bk, bk)
    scales = (blocks.abs().amax((1, 3)) / FP8_MAX).clamp(min=1e-12)
    full = scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w32 / full).to(FP8), scales


def expand_fp8_scales(scales: torch.Tensor, n: int, k: int,
                      block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's FP8 scales (per tensor, per channel [N, 1] or per block) -> [N, G]."""
    s = scales.float()
    if block is None:
        if s.numel() == 1:
            return s.reshape(1, 1).expand(n, 1).clone()
        return s.reshape(n, 1).clone()
    bn, bk = block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(s.shape) != expected:
        raise ValueError(f"fp8 block scales of shape {list(s.shape)} for a [{n}, {k}] weight in "
                         f"{bn}x{bk} blocks; expected {list(expected)}")
    return s.repeat_interleave(bn, 0)[:n].contiguous()
