"""The `triton` attention backend: paged decode and prefill kernels in Triton.

A step's K/V are written by `forward_rotary` in the same kernel that rotates q and k
(`workers.kernels.rope_kv`), or by `write_kv` (one index_copy per cache half) when `forward` is
given rotated ones (a latent cache). The leading `num_decodes` sequences go to the split-K
decode kernel in one launch (plus a merge); the rest go to the varlen prefill kernel in one
launch. Over a rotated (8-bit) cache the kernels attend in the cache's basis: q (and a fresh
prompt's own k/v) rotated before them, the output rotated back after
(`workers.kernels.kv_quant.rotate`; two small matmuls a step, outside the kernels).

On CPU tensors the kernels run in Triton's interpreter, which needs TRITON_INTERPRET=1 set before
this module is imported; that is how the tests run it.
"""

from __future__ import annotations

import torch

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.attention.decode_splits import (
    DecodeScratch,
    choose_num_splits,
    device_num_sms,
    max_split_rows,
)
from workers.attention.torch_backend import write_kv
from workers.attention.triton_decode import paged_decode_attention
from workers.attention.triton_prefill import paged_prefill_attention
from workers.kernels.kv_quant import rotate, rotates
from workers.kernels.rope_kv import rope_and_store


class TritonAttentionBackend(AttentionBackend):
    """Pure-decode forwards are CUDA-graph capturable: lengths and block tables are read on the
    device, and `num_splits` comes from the host metadata (a capture passes the longest length
    it will replay with). Prefill forwards copy a small tile list to the device each step.

    NOTE: holds one split scratch buffer shared by every layer, so one instance must not run two
    forwards at once (each model builds its own). The buffer is sized once for every split count
    `choose_num_splits` can pick and never reallocated afterwards, so graphs captured over it
    stay valid."""

    name = "triton"
    cuda_graph_safe = True  # read by workers.engine.cuda_graphs
    rotates_qk = True  # has forward_rotary: RoPE and the KV write in one kernel

    def __init__(self) -> None:
        self._scratch: DecodeScratch | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return self._attend(q, k, v, kv_cache, meta, scale, window, sinks)

    def forward_rotary(self, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, *, window: int | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` of unrotated q and k: one kernel rotates them (in place) at `positions`
        [T] from `cos_sin_cache` [max_position, D] (cos | sin, q's dtype;
        `workers.models.rotary.cos_sin_cache`) and stores k and v in the cache, as
        `RotaryEmbedding` then `write_kv` would. A latent cache takes `forward`."""
        rope_and_store(positions, q, k, v, cos_sin_cache, kv_cache, meta.slot_mapping)
        return self._attend(q, k, v, kv_cache, meta, scale, window, sinks)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None,
                sinks: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the cache, whose new K/V (`k`, `v`, rotated) are
        written."""
        nd, cache_dtype = meta.num_decodes, kv_cache.dtype
        if rotates(cache_dtype):  # attend in the cache's basis; the output rotated back
            q = rotate(q, cache_dtype)
            if nd < meta.num_seqs:  # a fresh prompt attends its own k/v
                k, v = rotate(k, cache_dtype), rotate(v, cache_dtype)
        out = torch.empty_like(q)
        if nd:
            num_splits = choose_num_splits(nd, kv_cache.shape[3], max(meta.seq_lens_cpu[:nd]),
                                           device_num_sms(q.device))
            self._decode(q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                         out[:nd], num_splits, None, window, sinks)
        if nd < meta.num_seqs:
            paged_prefill_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens,
                                    meta.block_tables, scale, meta.query_start_loc_cpu,
                                    first_seq=nd, out=out, window=window, sinks=sinks, k=k,
                                    v=v)
        return rotate(out, cache_dtype)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, out: torch.Tensor, num_splits: int,
               scratch: DecodeScratch | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention only, into `out` [B, Hq, D], for a caller that fixes the shapes (a
        CUDA-graph runner driving attention itself). The new tokens' K/V must already be in the
        cache (`write_kv`).

        For capture: pick `num_splits` once per graph (`choose_num_splits` with the longest
        length the graph may replay with); pass a `scratch` from `DecodeScratch.allocate(
        max_split_rows(num_kv_heads, num_sms), num_heads, head_dim, device)` (or rows = the
        largest batch x num_splits used), or leave it None to use the backend's own; and run
        once before capture so the kernels are compiled. Nothing then syncs, and nothing is
        allocated but a rotated cache's two rotations (from the graph's pool when captured);
        block_tables [B, max_blocks] and seq_lens [B] are read on the device only, and padding
        rows may carry seq_len 0 (they get zeros). Over a rotated cache q is rotated
        first and `out` rotated back in place (`workers.kernels.kv_quant.rotate`)."""
        rotated = rotates(kv_cache.dtype)
        self._decode(rotate(q, kv_cache.dtype), kv_cache, block_tables, seq_lens, scale, out,
                     num_splits, scratch, window, sinks)
        if rotated:
            out.copy_(rotate(out, kv_cache.dtype))
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, out: torch.Tensor, num_splits: int,
                scratch: DecodeScratch | None, window: int | None,
                sinks: torch.Tensor | None) -> torch.Tensor:
        """`decode` in the cache's basis (q rotated already where the cache is)."""
        if scratch is None and num_splits > 1:
            scratch = self._scratch_for(q, kv_cache.shape[3], num_splits)
        return paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, num_splits,
                                      out=out, scratch=scratch, window=window, sinks=sinks)

    def _scratch_for(self, q: torch.Tensor, num_kv_heads: int, num_splits: int) -> DecodeScratch:
        """The shared scratch; allocated on first use with room for every split count
        `choose_num_splits` picks, so `forward` never reallocates it. Only an explicit `decode`
        with a larger batch x num_splits grows it (eagerly; never do that during capture)."""
        batch, num_heads, head_dim = q.shape
        scratch = self._scratch
        if scratch is None or not scratch.fits(batch, num_heads, head_dim, num_splits):
            rows = max(batch * num_splits, max_split_rows(num_kv_heads, device_num_sms(q.device)))
            scratch = self._scratch = DecodeScratch.allocate(rows, num_heads, head_dim, q.device)
        return scratch
