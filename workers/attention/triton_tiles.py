"""What the Triton decode and prefill attention kernels share: the online-softmax step over a
tile of keys (`attend_tile`; an 8-bit cache's rows scaled back, `dequantized`), where its
key and value rows are (`cached_rows`: through a sequence's block table; or a fresh chunk's own
k/v), and the host-side checks of the inputs both take."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels.kv_quant import storage_head_dim

# softmax is computed in base 2 (exp2 is one instruction); logits are scaled by log2(e) first
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def cached_rows(table, pos, pos_ok, kv_head, stride_cache_block, stride_cache_token,
                stride_cache_head, BLOCK_SIZE: tl.constexpr):
    """Offsets in a cache plane of the KV head's row at each position `pos` of one sequence
    (found through its block `table`)."""
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    return (block * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_token
            + kv_head * stride_cache_head)


@triton.jit
def dequantized(rows_ptr, values, kv_ok, dims, DIM: tl.constexpr):
    """An 8-bit cache's rows [keys, dims] (`values`, as loaded from `rows_ptr`) times their
    scales: the fp32 scale of each group of DIM / 4 values, stored after the row's DIM values
    (`workers.kernels.kv_quant`); 0 where a key or dim does not exist."""
    scales_ptr = (rows_ptr + DIM).to(tl.pointer_type(tl.float32))
    scales = tl.load(scales_ptr[:, None] + (dims // (DIM // 4))[None, :], mask=kv_ok, other=0.0)
    return values.to(tl.float32) * scales


@triton.jit
def attend_tile(q, m, l, acc, k_rows, v_rows, pos_ok, visible, dims, dim_ok, qk_scale,
                DOT_PRECISION: tl.constexpr, DIM: tl.constexpr, SCALED: tl.constexpr):
    """One step of the online softmax over a tile of keys for the query rows `q`: returns the
    new running max `m` (base-2 logits), sum `l` and output accumulator `acc`. `k_rows`,
    `v_rows`: a pointer per key to its key and value row (in the cache, `cached_rows`, or in
    a fresh chunk's k/v); `visible`: which (row, key) pairs count, broadcastable to [rows,
    keys]; `pos_ok`: which keys exist; `SCALED`: rows of an 8-bit cache, each value times its
    group's scale before the dots (a scale per quarter row does not factor out of a key's dot
    as one per row did). Shared by the decode and prefill kernels."""
    kv_ok = pos_ok[:, None] & dim_ok[None, :]  # dims past a head size that is no power of 2
    k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)
    if SCALED:
        k = dequantized(k_rows, k, kv_ok, dims, DIM)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))  # [rows, keys]
    # a row with no visible key yet keeps m = -inf only until its first one; rows that have
    # one get exp2(-inf - m) = 0 for the masked keys
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_ok, other=0.0)
    if SCALED:
        v = dequantized(v_rows, v, kv_ok, dims, DIM)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                        input_precision=DOT_PRECISION)
    return m_new, l, acc


def interpreted() -> bool:
    """Whether the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(attend_tile, triton.runtime.JITFunction)


def dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast the dot operands to fp32, tl.dot input_precision) for inputs of `dtype`.

    fp32 uses "ieee": the default tf32 keeps ~10 mantissa bits and would miss 1e-5 tolerances.
    The precision has no effect on 16-bit operands. Triton 3.9's interpreter computes bf16 dots
    wrongly (errors of 1e10), so interpreted bf16 runs its dots in fp32."""
    upcast = dtype == torch.bfloat16 and interpreted()
    return upcast, "ieee" if dtype == torch.float32 or upcast else "tf32"


def check_layout(q: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Checks shared by the decode and prefill kernels; host metadata only (no device reads, so
    safe during graph capture)."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] not in (1, 2):
        raise ValueError(f"expected q [tokens, Hq, D] and kv_cache [2, blocks, block_size, Hkv, "
                         f"D], got {tuple(q.shape)} and {tuple(kv_cache.shape)}")
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != storage_head_dim(head_dim, kv_cache.dtype) or num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads of {head_dim}; the {kv_cache.dtype} cache "
                         f"has {num_kv_heads} KV heads of {cache_dim}; expected "
                         f"{storage_head_dim(head_dim, kv_cache.dtype)} (the head's values, "
                         f"and an 8-bit cache's scales) and Hq divisible by Hkv")
    if head_dim < 16 or block_size & (block_size - 1):
        raise ValueError(f"head_dim must be at least 16 (any size: tiles round it up to a power "
                         f"of two) and block_size a power of two, got head_dim {head_dim}, "
                         f"block_size {block_size}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous last (head_dim) dimension")
    if q.device.type == "cpu" and not interpreted():
        raise ValueError("Triton attention on CPU tensors needs TRITON_INTERPRET=1 set before "
                         "workers.attention's triton modules are imported")


def output_buffer(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked to fit q (shape, contiguous last dim), or a new one."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim, got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    return out
