"""8-bit KV caches: each token's key (and value) of each head in 8 bits with its own scale.

`--kv-cache-dtype int8` or `fp8` (e4m3) stores a head's `head_dim` values quantized by the
head's absolute maximum, followed by a 16-byte slot holding the fp32 scale's four bytes (the
other twelve are padding), in a cache of the 8-bit dtype:
`[planes, num_blocks, block_size, num_kv_heads, head_dim + 16]`. The scale travels inside the
block, so prefix caching, block copies and KV transfers move it with the values, and the layout
(dtype and last dimension) tells an 8-bit cache from a full-precision one. The slot is 16 bytes,
not 4, so that every row starts 16-byte aligned when head_dim is a multiple of 16: the GPU
kernels' loads then vectorize (with 4-byte slots, rows of 132 bytes, the compiled Triton decode
read byte by byte: a Llama-3-8B step at 256 x 1024 tokens took 92 ms against bf16's 19 on an
H200). A block takes (head_dim + 16) / (2 head_dim) of a bf16 block's bytes: 1.78x the blocks
at head_dim 128.
"""

from __future__ import annotations

import torch

KV_QUANT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
}
SCALE_ELEMS = 4  # the fp32 scale's bytes, as elements of the 1-byte cache dtype
SLOT_ELEMS = 16  # the slot after a row's values: the scale, then padding to 16 bytes
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def qmax(dtype: torch.dtype) -> float:
    """The largest value an 8-bit cache dtype stores: a head's absolute maximum maps to it."""
    return _QMAX[dtype]


def storage_head_dim(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension for `head_dim` values in `dtype`."""
    return head_dim + SLOT_ELEMS if is_quantized(dtype) else head_dim


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] -> [..., D + 16] of `dtype`: the values scaled into its range, then the scale's
    slot (its four bytes, twelve zero bytes)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / _QMAX[dtype]
    scaled = xf / scale
    values = (scaled.round().clamp(-127, 127).to(dtype) if dtype == torch.int8
              else scaled.to(dtype))
    pad = torch.zeros(*values.shape[:-1], SLOT_ELEMS - SCALE_ELEMS, dtype=dtype,
                      device=values.device)
    return torch.cat([values, scale.view(dtype), pad], dim=-1)


def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 16] 8-bit -> [..., D] in `dtype` (values times their scale)."""
    head_dim = stored.shape[-1] - SLOT_ELEMS
    scale = stored[..., head_dim:head_dim + SCALE_ELEMS].contiguous().view(torch.float32)
    return (stored[..., :head_dim].float() * scale).to(dtype)


def as_copyable(cache: torch.Tensor) -> torch.Tensor:
    """The cache as a dtype torch's CPU copy and gather kernels take (fp8 as its bytes)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """New keys or values [..., D] as a cache of `cache_dtype` stores them, in `as_copyable`'s
    dtype (8-bit: values and scale; else converted): the inverse of `read_kv`."""
    if not is_quantized(cache_dtype):
        return x.to(cache_dtype)
    stored = quantize_kv(x, cache_dtype)
    return stored.view(torch.uint8) if cache_dtype == torch.float8_e4m3fn else stored


def read_kv(stored: torch.Tensor, dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.Tensor:
    """Cache contents (of a cache of `cache_dtype`, perhaps viewed `as_copyable`) as `dtype`
    values: dequantized when 8-bit, else converted."""
    if not is_quantized(cache_dtype):
        return stored.to(dtype)
    return dequantize_kv(stored.view(cache_dtype), dtype)
