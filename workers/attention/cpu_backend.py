"""The `cpu` attention backend: decode attention by a small C kernel that reads K/V straight from
the paged cache; prefill as the torch backend does it (SDPA's flash kernel already runs those
well).

On the CPU a decode step is bound by reading the cached K/V. The torch backend gathers each
sequence's blocks into a contiguous copy, then SDPA reads the copy: three passes over the bytes.
`csrc/paged_decode.c` reads each byte once, with an online softmax, on torch's own OpenMP
threads. On `benchmarks/engine_throughput.py`'s 128 requests (`small` preset, fp32, 2 cores, the
two backends run back to back, twice) all decode attention took 6.3-6.5 s against the torch
backend's 18.6-18.8 s, and the whole run 44.5-46.9 s against 52.6-54.6 s
(csrc/paged_decode.c says how the kernel was chosen).

The kernel is compiled at first use with the system C compiler (`$CC`, default `cc`) for the host
CPU and cached under `$CLEAVE_CACHE_DIR/kernels/` (default `~/.cache/cleave/kernels/`), keyed by
the source, the flags and the CPU, as Triton and torch's extensions cache theirs. Without a
compiler, `attention_backend="auto"` falls back to the torch backend with a warning; asking for
`cpu` by name raises. The kernel takes fp32 or bf16 caches (bf16 read as fp32: the scores, softmax
and sums are fp32, the output rounded once), head sizes that are multiples of 8 and a contiguous
cache; anything else decodes through the torch backend's path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from workers.attention.backend import AttentionMetadata
from workers.attention.torch_backend import TorchAttentionBackend
from workers.kernels.native import KernelBuildError, build_library, loads

__all__ = ["KernelBuildError", "available", "build_kernel", "load_kernel", "paged_decode"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parents[1] / "kernels" / "csrc" / "paged_decode.c"
KV_DTYPES = (torch.float32, torch.bfloat16)  # caches the kernel reads


def build_kernel(compiler: str | None = None) -> Path:
    """The compiled decode kernel (`workers.kernels.native.build_library`)."""
    return build_library(SOURCE, compiler)


@functools.cache
def load_kernel() -> ctypes.CDLL:
    """The loaded kernel library (built if needed); raises KernelBuildError."""
    lib = ctypes.CDLL(str(build_kernel()))
    fn = lib.paged_decode_f32
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int64, ptr, ptr,
                   i32, i32, i32, i32, i32, ctypes.c_float, i32, i32, i32]
    fn.restype = i32
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads here; warns once, with the reason, when it does not."""
    return loads(load_kernel, "the cpu attention kernel is unavailable, decoding with the "
                              "torch backend instead", logger)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 num_threads: int | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One new query token per sequence over its paged context. q: [B, Hq, D] fp32 on the CPU;
    kv_cache: [2, num_blocks, block_size, Hkv, D] fp32 or bf16 (read as fp32); block_tables:
    [B, >= blocks needed]; seq_lens: [B] (context length including the new token); window:
    attend only the last `window` tokens; sinks: [Hq] fp32 attention-sink logits. Returns
    [B, Hq, D] fp32. Threads default to torch's. Consecutive rows with one context (a
    verification's: the same blocks, seq_lens one apart) are attended in one pass over it; a
    row's result is the same bit for bit alone or with them, on any thread count."""
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_dim = kv_cache.shape
    if q.dtype != torch.float32 or kv_cache.dtype not in KV_DTYPES:
        raise TypeError(f"paged_decode takes a float32 q and a float32 or bfloat16 cache, got "
                        f"{q.dtype} and {kv_cache.dtype}")
    if q.device.type != "cpu" or kv_cache.device.type != "cpu":
        raise ValueError(f"paged_decode runs on the CPU, got q on {q.device} and the cache on "
                         f"{kv_cache.device}")
    if kv_dim != head_dim or num_heads % num_kv_heads or head_dim % 8:
        raise ValueError(f"q has {num_heads} heads of {head_dim}; the cache has {num_kv_heads} "
                         f"KV heads of {kv_dim}; expected equal head sizes, a multiple of 8, and "
                         "query heads a multiple of KV heads")
    if not kv_cache.is_contiguous():
        raise ValueError("paged_decode needs a contiguous KV cache")
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [{num_heads}] (one per query head), got "
                             f"{list(sinks.shape)}")
    if out is None:
        out = torch.empty_like(q)
    rc = load_kernel().paged_decode_f32(
        q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[-1].data_ptr(),
        None if sinks is None else sinks.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads,
        head_dim, block_size, scale, window or 0, int(kv_cache.dtype == torch.bfloat16),
        num_threads or torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_decode could not allocate its per-sequence scratch")
    return out


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        load_kernel()  # build now, at model load, and fail there if it cannot be built

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
        if (q.dtype != kv_cache.dtype or kv_cache.dtype not in KV_DTYPES
                or q.device.type != "cpu" or q.shape[-1] % 8 or not kv_cache.is_contiguous()):
            return super()._decode(q, kv_cache, meta, scale, window, sinks)
        batch = q.shape[0]
        out = paged_decode(q.float(), kv_cache, meta.block_tables[:batch],
                           meta.seq_lens[:batch], scale, window=window, sinks=sinks)
        return out.to(q.dtype)  # bf16: rounded once, at the end
