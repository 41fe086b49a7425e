"""Paged prefill attention in Triton: a varlen batch of chunks, all read from the paged cache.

Run after the chunk's own K/V were written to the cache, so every key and value (cached or new)
is read the same way, through the block table. A chunk of Lq tokens ending at seq_len covers
positions [seq_len - Lq, seq_len) and each of its tokens attends causally up to itself. One
launch covers every prefill sequence of a step: the grid is (query tiles, query heads), and the
host lists each tile's sequence and offset (from `query_start_loc_cpu`), so a tile never spans
two sequences and the kernel needs no search. The list goes to the device once per step, not
once per layer: `prefill_tiles` keeps the last step's (keyed by the identity of the host list
every layer of a step is handed) and uploads without waiting (`host_transfer.upload`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from workers.kernels.kv_quant import is_quantized, plane_views
from workers.attention.triton_tiles import (
    LOG2E,
    attend_tile,
    cached_rows,
    check_layout,
    dot_config,
    output_buffer,
)
from workers.kernels.host_transfer import upload

# Query rows and keys per tile. 64 x 64 with head_dim up to 128 keeps q, one K/V tile and the
# accumulator in registers/shared memory at 4 warps on current NVIDIA parts; short chunks waste
# the unused rows of their last tile, which prefill (compute-light per byte here) tolerates.
BLOCK_M = 64
BLOCK_N = 64  # >= BLOCK_M: the sliding-window start in _prefill_kernel relies on it


# the block-table width and the window vary per step and layer: never specialised on (a new
# value would compile a variant while serving; see triton_decode)
@triton.jit(do_not_specialize=["window", "stride_table_seq"])
def _prefill_kernel(  # long: one kernel body; splitting it costs registers and clarity
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tiles_ptr, sinks_ptr, k_ptr, v_ptr,
    scale, window,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_cache_block, stride_cache_token, stride_cache_head,
    stride_table_seq,
    stride_out_token, stride_out_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr,
    SCALED: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tiles_ptr + 2 * tile)
    q_offset = tl.load(tiles_ptr + 2 * tile + 1)  # first query row of this tile in its chunk
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len

    rows = q_offset + tl.arange(0, TILE_M)
    row_ok = rows < q_len
    # absolute position of each query token; padding rows act as the chunk's last token, so
    # under a sliding window they too see a key in the first tile (and stay finite)
    q_pos = num_cached + tl.minimum(rows, q_len - 1)
    dims = tl.arange(0, HEAD_DIM)  # HEAD_DIM: the head size DIM rounded up to a power of 2
    dim_ok = dims < DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_token + head * stride_q_head
                + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    qk_scale = scale * LOG2E

    m = tl.full([TILE_M], float("-inf"), tl.float32)
    l = tl.zeros([TILE_M], tl.float32)
    if HAS_SINKS:  # the head's sink starts every row's softmax: max = its logit, sum = 1
        m = tl.zeros([TILE_M], tl.float32) + tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        l = l + 1.0
    acc = tl.zeros([TILE_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    # keys past the tile's last query position are masked for every row: stop before them;
    # under a sliding window, keys before the first row's window are seen by no row
    hi = tl.minimum(seq_len, num_cached + q_offset + TILE_M)
    lo = tl.where(window > 0, tl.maximum(num_cached + q_offset - window + 1, 0), 0)
    for start in range(lo, hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < hi
        # the first tile holds a key visible to every real row (key `lo` for row 0; row r's
        # window starts r keys later, and r < TILE_M == TILE_N), so after it m is finite; a
        # later fully masked row keeps m and adds exp2(-inf) = 0.
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        visible &= (window == 0) | (pos[None, :] > q_pos[:, None] - window)
        at = cached_rows(table, pos, pos_ok, kv_head, stride_cache_block, stride_cache_token,
                         stride_cache_head, BLOCK_SIZE)
        if SCALED:
            if num_cached == 0:  # a fresh prompt attends its own full-precision k/v (as torch)
                fresh = (q_start + pos).to(tl.int64)
                m, l, acc = attend_tile(q, m, l, acc,
                                        k_ptr + fresh * stride_k_token + kv_head * stride_k_head,
                                        v_ptr + fresh * stride_v_token + kv_head * stride_v_head,
                                        pos_ok, visible, dims, dim_ok, qk_scale, DOT_PRECISION,
                                        DIM, False)
            else:
                m, l, acc = attend_tile(q, m, l, acc, k_cache_ptr + at, v_cache_ptr + at, pos_ok,
                                        visible, dims, dim_ok, qk_scale, DOT_PRECISION, DIM,
                                        True)
        else:
            m, l, acc = attend_tile(q, m, l, acc, k_cache_ptr + at, v_cache_ptr + at, pos_ok,
                                    visible, dims, dim_ok, qk_scale, DOT_PRECISION, DIM, False)

    out = acc / l[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_out_token + head * stride_out_head
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


_last_tiles = threading.local()  # per thread: (host list, first_seq, device, tiles)


def prefill_tiles(query_start_loc_cpu: Sequence[int], first_seq: int,
                  device: torch.device | str) -> torch.Tensor:
    """[num_tiles, 2] int32: (sequence index, first query row in its chunk) of each BLOCK_M-row
    query tile of sequences first_seq.. . Every layer of a step passes the same host list
    object, so the tiles are built and uploaded once per step: the last call's result is
    reused while `query_start_loc_cpu` is the very same object (held here, so its id cannot be
    reused by a later list; a caller must not mutate it in place between layers)."""
    device = torch.device(device)
    last = getattr(_last_tiles, "entry", None)
    if (last is not None and last[0] is query_start_loc_cpu and last[1] == first_seq
            and last[2] == device):
        return last[3]
    flat = [v for seq in range(first_seq, len(query_start_loc_cpu) - 1)
            for row in range(0, query_start_loc_cpu[seq + 1] - query_start_loc_cpu[seq],
                             BLOCK_M)
            for v in (seq, row)]
    tiles = upload(flat, device, torch.int32).view(-1, 2)
    _last_tiles.entry = (query_start_loc_cpu, first_seq, device, tiles)
    return tiles


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, Hq, D]: the whole step's queries
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D], the chunks' K/V written
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 on q's device
    seq_lens: torch.Tensor,  # [num_seqs] int32: context after this step (cached + new)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    query_start_loc_cpu: Sequence[int],  # host copy of query_start_loc
    first_seq: int = 0,  # sequences before this one (decodes) are left alone
    out: torch.Tensor | None = None,  # [num_tokens, Hq, D]; only prefill rows are written
    window: int | None = None,  # each query sees only the last `window` positions up to itself
    sinks: torch.Tensor | None = None,  # [Hq] fp32 attention-sink logits
    k: torch.Tensor | None = None,  # [num_tokens, Hkv, D]: the step's new keys and values, as
    v: torch.Tensor | None = None,  # written (needed with an 8-bit cache)
) -> torch.Tensor:  # [num_tokens, Hq, D]
    """Causal attention of each chunk (sequences first_seq..) over its sequence's context. Over
    an 8-bit cache a fresh prompt (nothing cached before it) attends its own full-precision
    `k`/`v`, as the torch backend does; later chunks read the cache."""
    check_layout(q, kv_cache)
    scaled = is_quantized(kv_cache.dtype)
    if scaled and (k is None or v is None):
        raise ValueError("an 8-bit cache needs the step's k and v: a fresh prompt attends them")
    k = q if k is None else k  # unread without an 8-bit cache
    v = q if v is None else v
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2:4]
    out = output_buffer(q, out)
    tiles = prefill_tiles(query_start_loc_cpu, first_seq, q.device)
    if tiles.shape[0] == 0:
        return out
    upcast, precision = dot_config(q.dtype)
    k_cache, v_cache = plane_views(kv_cache)  # a latent cache: both; fp8's keys int8
    _prefill_kernel[(tiles.shape[0], num_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, tiles,
        q if sinks is None else sinks, k, v,
        scale, window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=triton.next_power_of_2(head_dim),
        DIM=head_dim, BLOCK_SIZE=block_size,
        TILE_M=BLOCK_M, TILE_N=BLOCK_N, UPCAST_DOT=upcast, DOT_PRECISION=precision,
        HAS_SINKS=sinks is not None, SCALED=scaled, num_warps=4,
    )
    return out
