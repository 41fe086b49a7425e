"""RMSNorm in one Triton launch, optionally after a residual add (vLLM's `fused_add_rms_norm`)
and with Gemma's `1 + weight` scale.

The arithmetic is transformers': the residual sum rounded to x's dtype; the mean of squares and
the normalization in fp32; Llama then rounds the normed row to x's dtype and multiplies by the
weight (rounded again), Gemma multiplies by `1 + weight` in fp32 and rounds once. In bf16 the
kernel therefore matches the torch path bit for bit but for the order of the fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, n, eps,
                     stride_x, stride_residual, stride_out,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr):
    """One program per row: out = norm(x (+ residual)); with a residual, the sum is written
    back over x's row (it is the next residual)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=ok)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:
        out = x32 * inv * (1.0 + w)
    else:  # normed rounded to x's dtype, then the weight's product rounded again
        out = (x32 * inv).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., n] (contiguous last dim) with weight [n]: a new
    contiguous tensor of x's shape and dtype. `gemma`: scale by 1 + weight.

    With `residual` (x [T, n] 2-D, residual of its shape): x += residual first, in place, so
    x then holds the next residual (vLLM's fused_add_rms_norm, the sum kept in x's buffer)."""
    n = x.shape[-1]
    if weight.shape != (n,) or x.stride(-1) != 1:
        raise ValueError(f"expected x [..., {n}] with a contiguous last dim and weight [{n}], "
                         f"got x {tuple(x.shape)} strides {x.stride()}, weight "
                         f"{tuple(weight.shape)}")
    if residual is not None:
        if x.dim() != 2 or residual.shape != x.shape or residual.stride(-1) != 1:
            raise ValueError(f"with a residual, expected x [T, n] and a residual of its shape "
                             f"with a contiguous last dim; got x {tuple(x.shape)}, residual "
                             f"{tuple(residual.shape)} strides {residual.stride()}")
        rows = x  # [T, n], written back
    else:
        rows = x.reshape(-1, n)  # a view, or a copy when the rows are not evenly strided
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [rows, n]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, rows if residual is None else residual, weight, out, n, eps,
            rows.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
            BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None, GEMMA=gemma,
            num_warps=4 if n <= 4096 else 8)
    return out.view(x.shape)
