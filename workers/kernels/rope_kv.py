"""RoPE of q and k and the paged KV write in one Triton launch (where torch issues ~16 ops for
the rotation and two `index_copy_` for the write).

One program per token rotates its query and key heads in place (neox halves: out[i] = x[i] cos
- x[i + h] sin, out[i + h] = x[i + h] cos + x[i] sin, with cos/sin from the model's shared cache
in the activations' dtype, `workers.models.rotary.cos_sin_cache`), then stores its key and
value heads at its slot of the cache. In 16-bit dtypes each product is rounded to the dtype
before the sum, as torch's ops do one by one, so the result is the torch path's bit for bit.

The torch fallback is the composition this replaces: `RotaryEmbedding.forward` then
`workers.attention.torch_backend.write_kv`. An 8-bit cache's rows are Hadamard-rotated after
RoPE, before their scales (`workers.kernels.kv_quant.rotate`; an fp8 cache's keys are stored as
int8, `kv_quant.key_dtype`): the matrix's entries are made in the kernel from their indices and
each row multiplied by it, summed in fp32 (in another order than torch's matmul, so a stored
value may differ from the torch path's by one rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels.kv_quant import (
    is_quantized,
    plane_views,
    qmax,
    rotates,
    rotation_block,
    storage_head_dim,
)


@triton.jit
def _rotate_heads(x_ptr, stride_head, heads, cos, sin, HALF: tl.constexpr,
                  HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, ROUND: tl.constexpr):
    """Rotates `heads` rows of one token in place; returns the rotated halves (fp32)."""
    h = tl.arange(0, HEADS_BLOCK)[:, None]
    d = tl.arange(0, HALF_BLOCK)[None, :]
    ok = (h < heads) & (d < HALF)
    first = x_ptr + h * stride_head + d
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    a, b, c, e = x1 * cos, x2 * sin, x2 * cos, x1 * sin
    if ROUND:  # each product rounded to the dtype, as torch's 16-bit ops are
        dtype = x_ptr.dtype.element_ty
        a, b = a.to(dtype).to(tl.float32), b.to(dtype).to(tl.float32)
        c, e = c.to(dtype).to(tl.float32), e.to(dtype).to(tl.float32)
    o1, o2 = a - b, c + e
    tl.store(first, o1.to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(first + HALF, o2.to(x_ptr.dtype.element_ty), mask=ok)
    return o1, o2, h, d, ok


@triton.jit
def _round_half_even(x):
    """x rounded to the nearest integer, ties to even, as torch.round."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _e4m3_rounded(x):
    """fp32 x rounded to e4m3's precision, ties to even (3 mantissa bits; steps of 2^-9 below
    2^-6), still fp32: its conversion to fp8 is then exact. The conversion would round the same
    way on a GPU, but Triton 3.9's interpreter loses the carry into the exponent for some
    values (124.0 became 64.0, 1.95 became 1.0), and the tests run there."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    small = _round_half_even(x * 512.0) / 512.0
    small = tl.where(small == 0.0, x * 0.0, small)  # -0.0 for a negative x, as torch rounds
    return tl.where(tl.abs(x) < 0.015625, small, normal)


@triton.jit
def _quantized(x, scale, cache_ptr, QMAX: tl.constexpr, INT8: tl.constexpr):
    """x [heads, n] (fp32) divided by its `scale` (per value) into the 8-bit cache's dtype, as
    `workers.kernels.kv_quant.quantize_kv` does (int8 rounded half to even)."""
    scaled = x / scale
    if INT8:
        scaled = tl.minimum(tl.maximum(_round_half_even(scaled), -QMAX), QMAX)
    else:
        scaled = _e4m3_rounded(scaled)
    return scaled.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_groups(x, cols, ok, heads_ok, row_ptr, scales_ptr, FIRST: tl.constexpr,
                  GROUPS: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr,
                  INT8: tl.constexpr):
    """Stores x [heads, n] (fp32; columns `cols` of their rows) in an 8-bit cache: groups FIRST..
    FIRST + GROUPS - 1 of GROUP values each by its absolute maximum, and their fp32 scales at
    `scales_ptr` + group (`workers.kernels.kv_quant`: four groups a row)."""
    scale = x * 0.0 + 1.0
    for g in tl.static_range(GROUPS):
        in_group = (cols >= (FIRST + g) * GROUP) & (cols < (FIRST + g + 1) * GROUP)
        group_scale = tl.maximum(tl.max(tl.where(in_group, tl.abs(x), 0.0), 1), 1e-12) / QMAX
        tl.store(scales_ptr + FIRST + g, group_scale[:, None], mask=heads_ok)
        scale = tl.where(in_group, group_scale[:, None], scale)
    tl.store(row_ptr + cols, _quantized(x, scale, row_ptr, QMAX, INT8), mask=ok)


@triton.jit
def _hadamard(rows, cols, n, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """Entries (rows, cols) of the block-diagonal orthonormal Hadamard matrix of `n` x `n`
    (blocks of BLOCK: (-1)^popcount(i & j) / sqrt(BLOCK) within a block, 0 across blocks and
    outside n), as `workers.kernels.kv_quant.hadamard` builds it."""
    both = rows & cols & (BLOCK - 1)
    parity = both * 0
    for bit in tl.static_range(LOG2_BLOCK):
        parity = parity ^ ((both >> bit) & 1)
    inside = ((rows // BLOCK) == (cols // BLOCK)) & (rows < n) & (cols < n)
    sign = tl.where(parity == 1, -1.0, 1.0) / tl.sqrt(BLOCK * 1.0)
    return tl.where(inside, sign, 0.0)


@triton.jit
def _rotated(x, first, n, ROWS: tl.constexpr, DIM_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
             LOG2_BLOCK: tl.constexpr):
    """x [heads, ROWS] (columns first.. of rows of n values) times rows first..first + ROWS of
    the Hadamard matrix: their share of the rotated rows [heads, DIM_BLOCK] (fp32)."""
    i = first + tl.arange(0, ROWS)[:, None]
    j = tl.arange(0, DIM_BLOCK)[None, :]
    h = _hadamard(i, j, n, BLOCK, LOG2_BLOCK)
    return tl.sum(x[:, :, None] * h[None, :, :], 1)


@triton.jit
def _rope_store_kernel(
    positions_ptr, slots_ptr, cos_sin_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr,
    num_heads, num_kv_heads,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token,
    stride_v_head, stride_cos_sin, stride_cache_block, stride_cache_token, stride_cache_head,
    BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, DIM: tl.constexpr,
    Q_HEADS_BLOCK: tl.constexpr, KV_HEADS_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
    DIM_BLOCK: tl.constexpr, ROUND: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr,
    K_QMAX: tl.constexpr, K_INT8: tl.constexpr, ROT_BLOCK: tl.constexpr,
    LOG2_ROT_BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_BLOCK)[None, :]
    row = cos_sin_ptr + pos * stride_cos_sin
    cos = tl.load(row + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_q_token, stride_q_head, num_heads, cos, sin, HALF,
                  Q_HEADS_BLOCK, HALF_BLOCK, ROUND)
    k1, k2, h, d, ok = _rotate_heads(k_ptr + token * stride_k_token, stride_k_head,
                                     num_kv_heads, cos, sin, HALF, KV_HEADS_BLOCK, HALF_BLOCK,
                                     ROUND)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot stores nothing
        at = ((slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_token
              + h * stride_cache_head)
        k_dst = k_cache_ptr + at + d
        dims = tl.arange(0, DIM_BLOCK)[None, :]
        v_ok = (h < num_kv_heads) & (dims < DIM)
        v = tl.load(v_ptr + token * stride_v_token + h * stride_v_head + dims, mask=v_ok,
                    other=0.0)
        if QMAX > 0:  # an 8-bit cache: each quarter row by its absolute maximum, the scales
            # the rotated k as stored in k (the activations' dtype), as the torch path reads it
            k1 = k1.to(k_ptr.dtype.element_ty).to(tl.float32)
            k2 = k2.to(k_ptr.dtype.element_ty).to(tl.float32)
            heads_ok = h < num_kv_heads
            f32 = tl.pointer_type(tl.float32)
            k_row, v_row = k_cache_ptr + at, v_cache_ptr + at
            v = v.to(tl.float32)
            if ROT_BLOCK > 0:  # rows rotated (after RoPE), then stored whole
                k = (_rotated(k1, 0, DIM, HALF_BLOCK, DIM_BLOCK, ROT_BLOCK, LOG2_ROT_BLOCK)
                     + _rotated(k2, HALF, DIM, HALF_BLOCK, DIM_BLOCK, ROT_BLOCK, LOG2_ROT_BLOCK))
                v = _rotated(v, 0, DIM, DIM_BLOCK, DIM_BLOCK, ROT_BLOCK, LOG2_ROT_BLOCK)
                _store_groups(k, dims, v_ok, heads_ok, k_row, (k_row + DIM).to(f32), 0, 4,
                              DIM // 4, K_QMAX, K_INT8)
            else:
                _store_groups(k1, d, ok, heads_ok, k_row, (k_row + DIM).to(f32), 0, 2,
                              DIM // 4, K_QMAX, K_INT8)
                _store_groups(k2, d + HALF, ok, heads_ok, k_row, (k_row + DIM).to(f32), 2, 2,
                              DIM // 4, K_QMAX, K_INT8)
            _store_groups(v, dims, v_ok, heads_ok, v_row, (v_row + DIM).to(f32), 0, 4,
                          DIM // 4, QMAX, INT8)
        else:
            tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(k_dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=ok)
            tl.store(v_cache_ptr + at + dims, v.to(v_cache_ptr.dtype.element_ty), mask=v_ok)


def rope_and_store(
    positions: torch.Tensor,  # [T] int64 (or int32), each < cos_sin_cache.shape[0]
    q: torch.Tensor,  # [T, Hq, D], contiguous last dim: rotated in place
    k: torch.Tensor,  # [T, Hkv, D], contiguous last dim: rotated in place
    v: torch.Tensor,  # [T, Hkv, D], contiguous last dim
    cos_sin_cache: torch.Tensor,  # [max_position, D] in q's dtype: cos | sin
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]: k and v stored at their slots
    slot_mapping: torch.Tensor,  # [T] int64 slot of each token (negative: not stored)
) -> None:
    """Rotates q and k in place and stores the rotated k and v in the cache, in one launch.
    Positions are not bounds-checked on the device (the caller keeps them in the cache)."""
    tokens, num_heads, dim = q.shape
    planes, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if (k.shape != (tokens, num_kv_heads, dim) or v.shape != k.shape or planes != 2
            or cache_dim != storage_head_dim(dim, kv_cache.dtype) or dim % 2
            or cos_sin_cache.shape[-1] != dim):
        raise ValueError(
            f"expected q [T, Hq, D], k and v [T, Hkv, D], kv_cache [2, blocks, block_size, Hkv, "
            f"D] (D + 16 when 8-bit: `workers.kernels.kv_quant`) and cos_sin_cache "
            f"[max_position, D] with D even; got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}, v {tuple(v.shape)}, kv_cache {tuple(kv_cache.shape)}, "
            f"cos_sin_cache {tuple(cos_sin_cache.shape)}")
    if positions.shape != (tokens,) or slot_mapping.shape != (tokens,):
        raise ValueError(f"expected positions and slot_mapping [{tokens}], got "
                         f"{tuple(positions.shape)} and {tuple(slot_mapping.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, cos_sin_cache, kv_cache)):
        raise ValueError("q, k, v, cos_sin_cache and kv_cache need a contiguous last dim")
    if cos_sin_cache.dtype != q.dtype or k.dtype != q.dtype:
        raise ValueError(f"q, k and the cos/sin cache must share a dtype, got {q.dtype}, "
                         f"{k.dtype} and {cos_sin_cache.dtype}")
    if tokens == 0:
        return
    k_cache, v_cache = plane_views(kv_cache)  # an fp8 cache's keys: int8
    half = dim // 2
    rot_block = rotation_block(dim) if rotates(kv_cache.dtype) else 0
    _rope_store_kernel[(tokens,)](
        positions, slot_mapping, cos_sin_cache, q, k, v, k_cache, v_cache,
        num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, HALF=half, DIM=dim,
        Q_HEADS_BLOCK=triton.next_power_of_2(num_heads),
        KV_HEADS_BLOCK=triton.next_power_of_2(num_kv_heads),
        HALF_BLOCK=triton.next_power_of_2(half), DIM_BLOCK=triton.next_power_of_2(dim),
        ROUND=q.dtype != torch.float32,
        QMAX=qmax(kv_cache.dtype) if is_quantized(kv_cache.dtype) else 0.0,
        INT8=kv_cache.dtype == torch.int8,
        K_QMAX=qmax(k_cache.dtype) if is_quantized(k_cache.dtype) else 0.0,
        K_INT8=k_cache.dtype == torch.int8, ROT_BLOCK=rot_block,
        LOG2_ROT_BLOCK=max(rot_block.bit_length() - 1, 0), num_warps=4,
    )
