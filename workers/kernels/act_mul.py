"""act(gate) * up from the fused gate_up projection's output, in one Triton launch (where torch
issues two: the activation, then the product).

The arithmetic is the torch path's (`LlamaMLP`): the activation computed in fp32 and rounded to
the dtype, then its product with `up` rounded again; silu, or gelu with the tanh approximation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# elements of one row per program
BLOCK = 1024


@triton.jit
def _act_mul_kernel(gate_up_ptr, out_ptr, inter, stride_in, stride_out,
                    BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=ok, other=0.0)
    if GELU:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(y) = 2 sigmoid(2y) - 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * inner)
    else:
        act = gate * tl.sigmoid(gate)
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def act_and_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate | up, contiguous last dim) -> act(gate) * up, a new [T, I]."""
    tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"expected gate_up [T, 2 * I] with a contiguous last dim, got shape "
                         f"{tuple(gate_up.shape)} strides {gate_up.stride()}")
    inter = width // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)  # [T, I]
    if tokens:
        _act_mul_kernel[(tokens, triton.cdiv(inter, BLOCK))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, GELU=gelu,
            num_warps=4)
    return out
