"""Paged attention in plain torch (scaled_dot_product_attention): the CPU backend and reference.

Decodes are batched into one SDPA call over the gathered context; prefill chunks run one
sequence at a time (they are long, so the loop costs little), reading cached tokens from the
paged cache only when the chunk starts after some. Over a rotated (8-bit) cache, attention runs
in the cache's basis: q (and a fresh prompt's own k/v) rotated before, the output rotated back
after (`workers.kernels.kv_quant.rotate`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.kernels.kv_quant import as_copyable, read_kv, rotate, rotates, to_cache


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V at their slots. kv_cache: [2, num_blocks, block_size, Hkv, D]
    (a latent cache, [1, ...], stores k only: its keys are its values; an 8-bit cache stores
    each head's values and scale, `workers.kernels.kv_quant`)."""
    planes, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = as_copyable(kv_cache).view(planes, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, to_cache(k, kv_cache.dtype, keys=True))
    if planes == 2:
        flat[1].index_copy_(0, slot_mapping, to_cache(v, kv_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence. cache: [num_blocks, bs, Hkv, D] -> [length,
    Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:length]


# Sequences per batched decode call. Small groups keep the gathered context (4 x ~400 tokens
# x 2 KiB of K/V each) in cache between the gather and SDPA and pad little; on the `small`
# preset (CPU, fp32) 4 took ~40% less decode-attention time than 16, and less than 1, 2 or 8.
MAX_DECODE_GROUP = 4
GROUP_LENGTH_RATIO = 1.5  # a group's longest context over its shortest, at most


def decode_groups(seq_lens: list[int]) -> list[tuple[int, int]]:
    """Split decodes into [start, end) runs to attend together. The runner sorts decodes by
    length, so runs of similar length are contiguous; unsorted input only pads more."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(seq_lens) + 1):
        if (i == len(seq_lens) or i - start == MAX_DECODE_GROUP
                or seq_lens[i] > GROUP_LENGTH_RATIO * seq_lens[start] + 16):
            groups.append((start, i))
            start = i
    return groups


class TorchAttentionBackend(AttentionBackend):
    """NOTE: holds one gather buffer reused by every decode group of every layer, so one
    instance must not run two forwards at once (each model builds its own)."""

    name = "torch"

    def __init__(self) -> None:
        self._gather_buf = torch.empty(0)
        self._kv_dtype = torch.float32  # the dtype of the cache the current forward reads

    def _gather_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A scratch tensor of `numel` elements; reused (not reallocated) so the gathered context
        lands in memory that is already mapped and cached."""
        buf = self._gather_buf
        if buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._gather_buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, *, window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        self._kv_dtype = cache_dtype = kv_cache.dtype
        kv_cache = as_copyable(kv_cache)  # 8-bit caches are read through read_kv
        nd = meta.num_decodes
        if rotates(cache_dtype):  # attend in the cache's basis; the output rotated back
            q = rotate(q, cache_dtype)
            if nd < meta.num_seqs:  # a fresh prompt attends its own k/v
                k, v = rotate(k, cache_dtype), rotate(v, cache_dtype)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale, window, sinks)
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(nd, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], kv_cache, meta.block_tables[i],
                                     lens[i], scale, window, sinks)
        return rotate(out, cache_dtype)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        # q: [B, Hq, D]; one new token per sequence. Sequences of similar length are attended
        # together, so the gathered context is padded little and stays cache-sized.
        out = torch.empty_like(q)
        for start, end in decode_groups(meta.seq_lens_cpu[:q.shape[0]]):
            out[start:end] = self._decode_group(q[start:end], kv_cache, meta, start, end, scale,
                                                window, sinks)
        return out

    def _decode_group(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      start: int, end: int, scale: float, window: int | None,
                      sinks: torch.Tensor | None) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        planes, num_blocks, block_size, num_kv_heads, stored_dim = kv_cache.shape
        group = num_heads // num_kv_heads
        max_len = max(meta.seq_lens_cpu[start:end])
        max_blocks = (max_len + block_size - 1) // block_size
        tables = meta.block_tables[start:end, :max_blocks].flatten()
        # whole blocks as rows: [planes, num_blocks, block_size * Hkv * D]
        blocks = kv_cache.view(planes, num_blocks, -1)
        buf = self._gather_buffer(planes * tables.numel() * blocks.shape[2], kv_cache)
        gathered = buf.view(planes, tables.numel(), blocks.shape[2])
        for plane in range(planes):
            torch.index_select(blocks[plane], 0, tables, out=gathered[plane])
        # keys/values: [B, Hkv, L, D], L = max_blocks * block_size (a latent's are the same)
        shape = (batch, max_blocks * block_size, num_kv_heads, stored_dim)
        keys = read_kv(gathered[0].view(shape), q.dtype, self._kv_dtype,
                       keys=True).transpose(1, 2)
        values = (keys if planes == 1
                  else read_kv(gathered[-1].view(shape), q.dtype, self._kv_dtype).transpose(1, 2))
        positions = torch.arange(keys.shape[2], device=q.device)
        lens = meta.seq_lens[start:end, None]
        mask = positions[None, :] < lens  # [B, L]
        if window is not None:
            mask &= positions[None, :] >= lens - window
        # query heads of one KV head packed along the query axis: [B, Hkv, group, D]
        qg = q.view(batch, num_kv_heads, group, head_dim)
        attn_mask = mask[:, None, None, :]
        if sinks is not None:
            keys, values, attn_mask = with_sinks(keys, values, attn_mask,
                                                 sinks.view(num_kv_heads, group, 1))
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=attn_mask, scale=scale)
        return out.reshape(batch, num_heads, head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: int, scale: float,
                 window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        # q: [Lq, Hq, D]; the chunk covers positions [seq_len - Lq, seq_len).
        query_len = q.shape[0]
        num_cached = seq_len - query_len
        # the first key any query of the chunk sees; whole blocks before it are not read
        first_key = 0 if window is None else max(0, num_cached - window + 1)
        if num_cached == 0:
            keys, values, key_start = k, v, 0
        else:
            block_size = kv_cache.shape[2]
            skip = first_key // block_size
            key_start = skip * block_size
            length = seq_len - key_start
            keys = read_kv(gather_context(kv_cache[0], block_table[skip:], length), q.dtype,
                           self._kv_dtype, keys=True)
            values = keys if kv_cache.shape[0] == 1 else read_kv(
                gather_context(kv_cache[-1], block_table[skip:], length), q.dtype,
                self._kv_dtype)
        mask = None
        if num_cached or (window is not None and window < query_len):
            key_pos = torch.arange(key_start, seq_len, device=q.device)
            query_pos = torch.arange(num_cached, seq_len, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [Lq, L]
            if window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - window
        # 4-D [1, H, L, D]: with 3-D inputs and a mask, CPU SDPA falls back to its unfused math
        # path (3-4x slower on a 400-token chunk after 500 cached tokens)
        keys = keys.transpose(0, 1).to(q.dtype)[None]
        values = values.transpose(0, 1).to(q.dtype)[None]
        if sinks is not None:
            if mask is None:  # causal, spelled out: the sink column joins it
                mask = torch.ones(query_len, seq_len, dtype=torch.bool, device=q.device).tril()
            keys, values, mask = with_sinks(keys, values, mask, sinks.view(-1, 1, 1))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)


def with_sinks(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention sinks as one more key that every query sees, with a zero value and a logit of
    the head's sink (an additive float mask: q . 0 + sink). keys/values [..., L, D]; mask
    boolean [..., L]; sinks shaped to broadcast against mask[..., :1] (decode: [Hkv, group,
    1], prefill: [H, 1, 1]). Returns keys/values [..., L + 1, D] and the float mask."""
    keys = F.pad(keys, (0, 0, 0, 1))
    values = F.pad(values, (0, 0, 0, 1))
    bias = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device)
    bias.masked_fill_(~mask, float("-inf"))
    shape = torch.broadcast_shapes(mask.shape[:-1] + (1,), sinks.shape)
    sink = sinks.to(keys.dtype).expand(shape)
    return keys, values, torch.cat([bias.expand(*shape[:-1], mask.shape[-1]), sink], dim=-1)
