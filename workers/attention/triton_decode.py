"""Paged decode attention in Triton: one new query token per sequence, flash-decoding style.

Each program owns one (sequence, KV head, split): it packs the `group = Hq // Hkv` query heads
that share the KV head into the rows of one tile, walks its split's share of the sequence's
tokens through the block table (read on the device), keeps an online softmax, and writes a
partial output with its log-sum-exp. A second small kernel merges the splits. With one split the
first kernel writes the final output and the merge is skipped.

Everything here is CUDA-graph capturable for a fixed batch and `num_splits` when `out` and
`scratch` are given: sequence lengths and block tables are read only on the device, nothing is
allocated, and nothing waits on the host. Launch once before capture so the kernels are compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.attention.decode_splits import MAX_SPLITS, DecodeScratch
from workers.kernels.kv_quant import is_quantized, plane_views
from workers.attention.triton_tiles import (
    LOG2E,
    attend_tile,
    cached_rows,
    check_layout,
    dot_config,
    output_buffer,
)

# Tokens per inner-loop step. 64 keys x 128 dims x 2 bytes is 16 KiB of K (and of V) per step:
# enough bytes in flight per program to stream the cache, little enough to keep registers and
# shared memory small. It is independent of the cache's block_size: each token finds its block
# through the table, so one tile may span several small blocks or part of a large one.
TILE_N = 64
# tl.dot needs at least 16 rows on NVIDIA tensor cores; the query heads of one KV head (the GQA
# group, often 1 to 8) are padded up to this and the extra rows masked.
MIN_GROUP_ROWS = 16


# Integer arguments that change from step to step (the split count, the block-table width, the
# strides of split scratch, a layer's window) are not specialised on: Triton would otherwise
# compile a variant the first time a value is 1 or not a multiple of 16, a stall of seconds
# in the middle of serving. The merge's SPLITS is MAX_SPLITS for every split count the planner
# picks (one variant; a split count of 2 reads 16 masked rows of a few hundred bytes), so what
# remains is WRITE_LSE, which goes with the output's dtype anyway (fp32 partials or the final
# output): two variants, compiled at start by `CudaGraphExecutor.warm_up`.
@triton.jit(do_not_specialize=["num_splits", "window", "stride_table_seq", "stride_out_seq",
                               "stride_out_head", "stride_out_split", "stride_lse_seq",
                               "stride_lse_head"])
def _decode_split_kernel(  # long: one kernel body; splitting it costs registers and clarity
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr, sinks_ptr,
    scale, num_splits, window,
    stride_q_seq, stride_q_head,
    stride_cache_block, stride_cache_token, stride_cache_head,
    stride_table_seq,
    stride_out_seq, stride_out_head, stride_out_split,
    stride_lse_seq, stride_lse_head,
    GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, WRITE_LSE: tl.constexpr,
    HAS_SINKS: tl.constexpr, SCALED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # the keys attended, [first, seq_len): the last `window` of them under a sliding window
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # this split's share: a contiguous run of whole tiles, [lo, hi); empty for short sequences
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - first, TILE), num_splits)
    lo = first + split * tiles_per_split * TILE
    hi = tl.minimum(lo + tiles_per_split * TILE, seq_len)

    rows = tl.arange(0, GROUP_ROWS)  # query heads of this KV head, padded
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)  # HEAD_DIM: the head size DIM rounded up to a power of 2
    dim_ok = dims < DIM
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [GROUP_ROWS, HEAD_DIM]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    qk_scale = scale * LOG2E

    m = tl.full([GROUP_ROWS], float("-inf"), tl.float32)  # running max (base-2 logits)
    l = tl.zeros([GROUP_ROWS], tl.float32)  # running sum of exp2(logit - m)
    if HAS_SINKS:  # the sink joins the first split's softmax once: max = its logit, sum = 1
        sink_row = row_ok & ((rows * 0 + split) == 0)  # [GROUP_ROWS] bool
        sink = tl.load(sinks_ptr + heads, mask=sink_row, other=float("-inf")) * LOG2E
        m = tl.where(sink_row, sink, m)
        l = tl.where(sink_row, 1.0, l)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for start in range(lo, hi, TILE):
        pos = start + tl.arange(0, TILE)
        pos_ok = pos < hi
        # every tile holds at least one valid key, so m stays finite after the first
        at = cached_rows(table, pos, pos_ok, kv_head, stride_cache_block, stride_cache_token,
                         stride_cache_head, BLOCK_SIZE)
        m, l, acc = attend_tile(q, m, l, acc, k_cache_ptr + at, v_cache_ptr + at, pos_ok,
                                pos_ok[None, :], dims, dim_ok, qk_scale, DOT_PRECISION, DIM,
                                SCALED)

    # an empty split (or a zero-length padding sequence) has l == 0: write zeros and lse = -inf,
    # which the merge weighs as nothing
    has_keys = l > 0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]
    out_rows = out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head
    tl.store(out_rows + split * stride_out_split + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lse_seq + heads * stride_lse_head + split, lse,
                 mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_part_seq", "stride_part_head",
                               "stride_part_split", "stride_lse_seq", "stride_lse_head",
                               "stride_out_seq", "stride_out_head"])
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_part_seq, stride_part_head, stride_part_split,
    stride_lse_seq, stride_lse_head,
    stride_out_seq, stride_out_head,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + seq * stride_lse_seq + head * stride_lse_head + splits,
                  mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    parts = tl.load(part_ptr + seq * stride_part_seq + head * stride_part_head
                    + splits[:, None] * stride_part_split + dims[None, :],
                    mask=split_ok[:, None] & (dims < DIM)[None, :], other=0.0)  # [SPLITS, HEAD_DIM]
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < DIM)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (int64 also accepted)
    seq_lens: torch.Tensor,  # [B] int32: context length including the new token; 0 = padding
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,  # [B, Hq, D], q's dtype; written in place when given
    scratch: DecodeScratch | None = None,  # needed when num_splits > 1; allocated if None
    window: int | None = None,  # attend only the last `window` tokens (sliding window)
    sinks: torch.Tensor | None = None,  # [Hq] fp32 attention-sink logits
    tile: int = TILE_N,  # keys per inner-loop step: a power of two >= 16
    num_warps: int = 4,  # of the split kernel's programs
) -> torch.Tensor:  # [B, Hq, D]
    """Attend each sequence's one query token over its first seq_lens[b] cached tokens (already
    holding the new token's K/V), or the last `window` of them; zeros where seq_len is 0.
    `tile` and `num_warps` are the split kernel's launch shape (each value compiles a variant
    of its own): the defaults are what the engine runs; `benchmarks/gpu_all.py` sweeps others
    at short contexts, where the GPU has to decide."""
    _check_decode_inputs(q, kv_cache, block_tables, seq_lens, num_splits)
    check_launch_shape(tile, num_warps)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    out = output_buffer(q, out)
    if batch == 0:
        return out
    target, lse, target_strides = _split_targets(out, scratch, num_splits)
    upcast, precision = dot_config(q.dtype)
    k_cache, v_cache = plane_views(kv_cache)  # a latent cache: both; fp8's keys int8
    group = num_heads // num_kv_heads
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, target, lse,
        q if sinks is None else sinks,
        scale, num_splits, window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        *target_strides,
        lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_ROWS=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=triton.next_power_of_2(head_dim), DIM=head_dim, BLOCK_SIZE=block_size,
        TILE=tile,
        UPCAST_DOT=upcast, DOT_PRECISION=precision, WRITE_LSE=num_splits > 1,
        HAS_SINKS=sinks is not None, SCALED=is_quantized(kv_cache.dtype), num_warps=num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            target, lse, out, num_splits,
            target.stride(0), target.stride(1), target.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            SPLITS=merge_width(num_splits), HEAD_DIM=triton.next_power_of_2(head_dim),
            DIM=head_dim,
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out


def _split_targets(out: torch.Tensor, scratch: DecodeScratch | None, num_splits: int
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Where the split kernel writes: `out` itself when unsplit (no LSE), else the scratch's
    partial outputs and LSEs (allocated when not given), with the output's strides."""
    if num_splits == 1:
        return out, out, (out.stride(0), out.stride(1), 0)  # lse unused: WRITE_LSE is off
    batch, num_heads, head_dim = out.shape
    if scratch is None:
        scratch = DecodeScratch.allocate(batch * num_splits, num_heads, head_dim, out.device)
    elif not scratch.fits(batch, num_heads, head_dim, num_splits):
        raise ValueError(f"scratch {tuple(scratch.partial_out.shape)} does not fit batch "
                         f"{batch} x {num_splits} splits of {num_heads} heads x {head_dim}")
    target, lse = scratch.views(batch, num_splits)
    return target, lse, target.stride()[:3]


def check_launch_shape(tile: int, num_warps: int) -> None:
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two of at least 16 (tl.dot's smallest), "
                         f"got {tile}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")


def merge_width(num_splits: int) -> int:
    """The merge kernel's SPLITS (a constexpr: one compiled variant per value): MAX_SPLITS for
    every count the planner picks, so a new split count never compiles; a larger explicit
    count, its next power of two."""
    return max(MAX_SPLITS, triton.next_power_of_2(num_splits))


def _check_decode_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, num_splits: int) -> None:
    check_layout(q, kv_cache)
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"expected block_tables [{batch}, max_blocks] and seq_lens [{batch}], "
                         f"got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
