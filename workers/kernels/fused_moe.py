"""A fused mixture-of-experts forward for GPU steps of any size, without host synchronisation
(the vLLM `fused_moe` design, our own code).

1. `align_by_expert`: the T * k (token, slot) pairs are sorted by expert on the device and each
   expert's group is padded to a multiple of BLOCK_M rows (`moe_align_block_size`): the sorted
   pair ids (padding: the sentinel T * k), each block's expert, and the padded total, all on the
   device. The row buffer is sized by the worst case T * k + E * (BLOCK_M - 1), so the launch
   grids depend on shapes only; blocks past the padded total return at once.
2. `_gate_up_kernel`: per block of rows and tile of the intermediate dim, x[token] @ w13[e]^T
   for gate and up (+ bias), then the activation (silu(gate) * up, or gpt-oss's clamped
   SwiGLU), written per sorted row.
3. `_down_kernel`: per block and tile of the hidden dim, hidden @ w2[e]^T (+ bias), times the
   pair's routing weight, written per (token, slot) pair in fp32; the k slots are then summed.

Rounding follows the torch loop: gate, up, the expert output rounded to the activations' dtype,
products accumulated in fp32 (fp32 inputs multiply in IEEE fp32, not TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_K = 32, 32


def _block_m(num_pairs: int) -> int:
    return 16 if num_pairs <= 256 else 64


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] local expert ids -> (sorted pair ids [R] int32, padding = T * k; block
    experts [R / block_m] int32; padded total [1] int32), R = the worst-case padded rows, with
    device ops only (no data-dependent shape, nothing read on the host)."""
    flat = ids.reshape(-1)  # [P]
    num_pairs, device = flat.numel(), flat.device
    rows = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # [P] pair ids by expert
    expert = flat[order]
    group_start = counts.cumsum(0) - counts  # first index of each expert in `order`
    rank = torch.arange(num_pairs, device=device) - group_start[expert]
    position = padded_end[expert] - padded[expert] + rank  # [P] row of each sorted pair
    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[position] = order.to(torch.int32)
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = block_expert.clamp_(max=num_experts - 1).to(torch.int32)  # past the end
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, sorted_ptr, block_expert_ptr, total_ptr, out_ptr,
                    num_pairs, top_k, hidden, inter, stride_x, stride_we, stride_wn,
                    stride_be, stride_out, alpha, limit, HAS_BIAS: tl.constexpr,
                    CLAMPED: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base = w_ptr + expert * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + token[:, None] * stride_x + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w_ok = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_ok, other=0.0)
        wu = tl.load(w_base + (cols + inter)[None, :] * stride_wn + ks[:, None], mask=w_ok,
                     other=0.0)  # [BK, BN]
        if IEEE:  # fp32 operands (see `fused_moe`), multiplied in IEEE fp32
            a = a.to(tl.float32)
            acc_g = tl.dot(a, wg.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(a, wu.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    if HAS_BIAS:
        acc_g += tl.load(b_ptr + expert * stride_be + cols, mask=col_ok, other=0.0)[None, :]
        acc_u += tl.load(b_ptr + expert * stride_be + inter + cols, mask=col_ok,
                         other=0.0)[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], act.to(dtype),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, b_ptr, weight_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                 out_ptr, num_pairs, hidden, inter, stride_h, stride_we, stride_wn, stride_be,
                 stride_out, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BK, BN]
        if IEEE:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + cols, mask=col_ok, other=0.0)[None, :]
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32)  # the expert's output, as torch rounds
    y = y * tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_out + cols[None, :], y,
             mask=valid[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor | None, b13: torch.Tensor | None = None,
              b2: torch.Tensor | None = None,
              clamped_swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate | up); w2 [E, H, I]; ids [T, k] local expert ids;
    weights [T, k] or None (all 1); b13 [E, 2I], b2 [E, H] optional -> sum over the k slots of
    weight * expert(x), [T, H] in x's dtype. Launches a fixed number of kernels; no host read."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    if w13.shape[2] != hidden or tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"expert weights w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not "
                         f"fit hidden size {hidden}")
    if ids.dim() != 2 or ids.shape[0] != tokens:
        raise ValueError(f"expected ids [{tokens}, k], got {tuple(ids.shape)}")
    top_k, inter = ids.shape[1], two_inter // 2
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    if weights is None:
        weights = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
    weights = weights.reshape(-1).contiguous()  # [P]
    block_m = _block_m(num_pairs)
    sorted_ids, block_expert, total = align_by_expert(ids, num_experts, block_m)
    num_blocks = block_expert.numel()
    # fp32 products in IEEE fp32 (not TF32); in the interpreter bf16 too (its bf16 dot is wrong)
    ieee = x.dtype == torch.float32 or not x.is_cuda
    hidden_rows = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    alpha, limit = clamped_swiglu if clamped_swiglu is not None else (1.0, 0.0)
    b13_arg = b13.contiguous() if b13 is not None else w13
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, BLOCK_N))](
        x, w13, b13_arg, sorted_ids, block_expert, total, hidden_rows, num_pairs, top_k,
        hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), b13_arg.stride(0),
        hidden_rows.stride(0), float(alpha), float(limit), HAS_BIAS=b13 is not None,
        CLAMPED=clamped_swiglu is not None, IEEE=ieee, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K)
    pair_out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    b2_arg = b2.contiguous() if b2 is not None else w2
    _down_kernel[(num_blocks, triton.cdiv(hidden, BLOCK_N))](
        hidden_rows, w2, b2_arg, weights, sorted_ids, block_expert, total, pair_out,
        num_pairs, hidden, inter, hidden_rows.stride(0), w2.stride(0), w2.stride(1),
        b2_arg.stride(0), pair_out.stride(0), HAS_BIAS=b2 is not None, IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return pair_out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)  # [T, H]
