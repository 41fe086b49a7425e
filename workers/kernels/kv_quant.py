"""8-bit KV caches: each token's key (and value) of each head in 8 bits, a scale per quarter row.

`--kv-cache-dtype int8` or `fp8` (e4m3 values, int8 keys: below) stores a head's `head_dim` values,
Hadamard-rotated (below), in four groups of `head_dim / 4` consecutive values, each quantized by
its own absolute maximum, followed by a 16-byte slot holding the four groups' fp32 scales, in a
cache of the 8-bit dtype: `[planes, num_blocks, block_size, num_kv_heads, head_dim + 16]`. The
scales travel inside the block, so prefix caching, block copies and KV transfers move them with the
values, and the layout (dtype and last dimension) tells an 8-bit cache from a full-precision one.
The slot is 16 bytes so that every row starts 16-byte aligned when head_dim is a multiple of 16:
the GPU kernels' loads then vectorize (with 4-byte slots, rows of 132 bytes, the compiled Triton
decode read byte by byte: a Llama-3-8B step at 256 x 1024 tokens took 92 ms against bf16's 19 on an
H200). A block takes (head_dim + 16) / (2 head_dim) of a bf16 block's bytes: 1.78x the blocks at
head_dim 128.

Why four scales, not one per row (the slot's first format, its other twelve bytes padding): keys
have outlier channels, a few dimensions an order of magnitude above the rest, and one scale
per row rounds every other value of the row on the outlier's coarse grid. On SmolLM2-135M
(head_dim 64) over real text (`benchmarks/quality.py`, `benchmarks/README.md`), an int8 cache
with one scale per row kept 97.9% of the fp32 cache's next-token argmaxes (1,140 positions);
with a scale per 16 values, 98.96% (3,670 positions, most of the rest near-ties).

Why rows are rotated: an orthonormal Hadamard rotation of each head's key and value spreads
an outlier channel over every value of the row, so the quarter scales no longer follow it. An
8-bit cache stores `quantize(H x)` (`rotate`, before the scales), and what it reads back is in
the rotated basis: attention over it takes a rotated query (q . k = (H q) . (H k)) and rotates
its output back once per row (sum p (H v) = H sum p v; H is symmetric and its own inverse).
`workers.attention`'s torch and triton backends do both; `workers.kernels.rope_kv` rotates
after RoPE, in the write it fuses. H is block-diagonal over blocks of the largest power of two
dividing head_dim (head_dim 64 or 128: the whole row; 96: blocks of 32; 80: of 16). On
SmolLM2-135M over real text the rotated int8 cache keeps 99.29% of the fp32 cache's argmaxes
where unrotated quarter scales kept 98.96%, measured in one run
(`benchmarks/results/quality_kv_int8.json`).

Why an fp8 cache keeps its keys in int8 (`key_dtype`): e4m3's error is relative to each value
(3 mantissa bits: up to 1/16 of it), several times int8's on a group of similar values, and a
key's error passes through the softmax's exponential. With e4m3 keys and values the cache kept
96.08% of SmolLM2's argmaxes over real text; the 98% the quality criterion asks is out of its
reach. Simulated on 10 passages (1,259 positions; keys and values quantized and dequantized as
they are written; the all-e4m3 format 95.95% there, as the engine's own): e4m3 keys alone
96.51%, e4m3 values alone 99.21%; rotated 96.27%; one scale a row 95.23%, no scale at all
95.31% (the range is not the limit), a scale per 4 values 97.93% (a group's maximum is stored
exactly: more scales, more exact values, at 4x the scales' bytes); e5m2 92.69%. Rotated int8
keys alone 99.52%, with e4m3 values 98.57% (values rotated or not), int8 for both 99.36%. An fp8
cache therefore stores its keys as rotated int8 (their bytes in the fp8 tensor, the same row
layout and scales) and its values as rotated e4m3 (`benchmarks/results/quality_kv_fp8.json`).
Its blocks carry the encoding "hadamard,int8-keys": they never land in a cache of the earlier
all-e4m3 format.
"""

from __future__ import annotations

import functools

import torch

KV_QUANT_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
}
SCALE_GROUPS = 4  # fp32 scales per row: one per head_dim / 4 consecutive values
SCALE_ELEMS = 4 * SCALE_GROUPS  # the scales' bytes, as elements of the 1-byte cache dtype
SLOT_ELEMS = 16  # the slot after a row's values: the scales (exactly 16 bytes)
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


# 8-bit cache dtypes whose rows are stored Hadamard-rotated, and the dtype a cache stores its
# keys in where not its own (both read at call time: a benchmark patches them to measure the
# earlier formats, `benchmarks/quality.py`)
ROTATED_DTYPES: frozenset[torch.dtype] = frozenset({torch.int8, torch.float8_e4m3fn})
KEY_DTYPES: dict[torch.dtype, torch.dtype] = {torch.float8_e4m3fn: torch.int8}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def qmax(dtype: torch.dtype) -> float:
    """The largest value an 8-bit cache dtype stores: a group's absolute maximum maps to it."""
    return _QMAX[dtype]


def storage_head_dim(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension for `head_dim` values in `dtype`."""
    if not is_quantized(dtype):
        return head_dim
    if head_dim % SCALE_GROUPS:
        raise ValueError(f"an 8-bit KV cache keeps a scale per head_dim / {SCALE_GROUPS} "
                         f"values; head_dim {head_dim} is not a multiple of {SCALE_GROUPS}")
    return head_dim + SLOT_ELEMS


def rotates(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` stores its rows Hadamard-rotated (`rotate`)."""
    return dtype in ROTATED_DTYPES


def key_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """The dtype a cache of `cache_dtype` stores its keys in (an fp8 cache's: int8, in the same
    bytes); its values are of its own dtype."""
    return KEY_DTYPES.get(cache_dtype, cache_dtype)


def plane_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's key and value planes [num_blocks, block_size, Hkv, D'] viewed in the dtypes
    they hold (`key_dtype`; a latent cache's one plane is keys, read as both)."""
    keys = kv_cache[0].view(key_dtype(kv_cache.dtype))
    return keys, keys if kv_cache.shape[0] == 1 else kv_cache[1]


def encoding(dtype: torch.dtype) -> str:
    """The transfer layer's name for how a cache of `dtype` encodes its values beyond the dtype
    (`kvtransfer.KVLayout.encoding`): a rotated cache's blocks never land in an unrotated one,
    nor int8 keys in an fp8 cache of e4m3 keys."""
    parts = ["hadamard"] if rotates(dtype) else []
    if key_dtype(dtype) != dtype:
        parts.append(f"{str(key_dtype(dtype)).removeprefix('torch.')}-keys")
    return ",".join(parts)


def rotation_block(head_dim: int) -> int:
    """The Hadamard blocks' size for `head_dim`: its largest power-of-two divisor."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return head_dim & -head_dim


@functools.cache
def hadamard(n: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix [n, n] (fp32, symmetric, its own inverse):
    entry (i, j) is (-1)^popcount(i & j) / sqrt(n)."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix here has a power-of-two size, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(device)


def rotate(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] in a `cache_dtype` cache's basis: each block of `rotation_block(D)` values
    times the Hadamard matrix (in fp32, returned in x's dtype), or x itself when the cache is
    not rotated. Its own inverse: it also rotates attention's output back."""
    if not rotates(cache_dtype):
        return x
    block = rotation_block(x.shape[-1])
    blocks = x.reshape(-1, block).float()  # one 2-D matmul: a batched one costs ~3x on a CPU
    return torch.mm(blocks, hadamard(block, x.device)).view(x.shape).to(x.dtype)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] -> [..., D + 16] of `dtype`: the row rotated where `dtype` is (`rotate`), each
    quarter of its D values scaled into range by its absolute maximum, then the slot of the
    four fp32 scales."""
    head_dim = x.shape[-1]
    storage_head_dim(head_dim, dtype)  # validates D
    groups = rotate(x.float(), dtype).reshape(*x.shape[:-1], SCALE_GROUPS, head_dim // SCALE_GROUPS)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / _QMAX[dtype]
    scaled = (groups / scale).reshape(x.shape)
    values = (scaled.round().clamp(-127, 127).to(dtype) if dtype == torch.int8
              else scaled.to(dtype))
    return torch.cat([values, scale.reshape(*x.shape[:-1], SCALE_GROUPS).view(dtype)], dim=-1)


def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 16] 8-bit -> [..., D] in `dtype` (each group's values times its scale), in the
    cache's basis: `rotate` the result to undo a rotated cache's rotation."""
    head_dim = stored.shape[-1] - SLOT_ELEMS
    scale = stored[..., head_dim:head_dim + SCALE_ELEMS].contiguous().view(torch.float32)
    values = stored[..., :head_dim].float().reshape(*stored.shape[:-1], SCALE_GROUPS, -1)
    return (values * scale[..., None]).reshape(*stored.shape[:-1], head_dim).to(dtype)


def as_copyable(cache: torch.Tensor) -> torch.Tensor:
    """The cache as a dtype torch's CPU copy and gather kernels take (fp8 as its bytes)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, *, keys: bool = False) -> torch.Tensor:
    """New keys (`keys`) or values [..., D] as a cache of `cache_dtype` stores them, in
    `as_copyable`'s dtype (8-bit: values and scale, keys in `key_dtype`; else converted): the
    inverse of `read_kv`."""
    if not is_quantized(cache_dtype):
        return x.to(cache_dtype)
    stored = quantize_kv(x, key_dtype(cache_dtype) if keys else cache_dtype)
    return stored.view(torch.uint8) if cache_dtype == torch.float8_e4m3fn else stored


def read_kv(stored: torch.Tensor, dtype: torch.dtype, cache_dtype: torch.dtype, *,
            keys: bool = False) -> torch.Tensor:
    """Cache contents (keys where `keys`, of a cache of `cache_dtype`, perhaps viewed
    `as_copyable`) as `dtype` values: dequantized when 8-bit (in the cache's basis: rotated
    where `rotates`), else converted."""
    if not is_quantized(cache_dtype):
        return stored.to(dtype)
    return dequantize_kv(stored.view(key_dtype(cache_dtype) if keys else cache_dtype), dtype)
