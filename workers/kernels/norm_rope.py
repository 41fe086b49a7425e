"""RMSNorm and rotary embeddings on the CPU by a C kernel (`csrc/norm_rope.c`): one call each,
where torch's are chains of small ops whose dispatch is most of a small model's decode step.

`rms_norm` and `rope` take what the model's `RMSNorm` and `RotaryEmbedding` take and return
None when the kernel does not apply (not the CPU, another dtype, a layout it does not read, no C
compiler here): the caller then computes it with torch. Results are torch's (bf16 rope exactly;
fp32 to the last bit or so: the sum of squares is added in another order).

Measured on this 2-core machine, the `small` preset (8 layers) decoding one sequence, each
module's forward timed in the engine: through torch the norms took 0.46-0.60 ms and the rotary
embeddings 0.50 ms of a step (6.4 ms fp32, 5.5 ms for its int8 copy in bf16); through the
kernel (q and k rotated in one call, `RotaryEmbedding.rotate_qk`) 0.2-0.3 and about 0.05, and
the int8 step, with bf16 caches read by the C attention kernel too, 3.8 ms.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from collections.abc import Callable

import torch

from workers.kernels.native import build_library, loads

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "norm_rope.c"


@functools.cache
def load_kernel() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE)))
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for fn in (lib.rms_norm_f32, lib.rms_norm_bf16):
        fn.argtypes = [ptr, i64, ptr, ptr, i64, i64, f32, i32]
        fn.restype = None
    for fn in (lib.rope_f32, lib.rope_bf16):
        fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32]
        fn.restype = i32
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads here; warns once, with the reason, when it does not."""
    return loads(load_kernel, "the norm/rope kernel is unavailable, using torch's ops", logger)


@functools.cache
def _functions() -> dict[torch.dtype, tuple[Callable[..., None], Callable[..., int]]]:
    """(rms_norm, rope) by dtype; empty when the kernel is unavailable. Looked up once: a
    decode step calls these a few times per layer, where each microsecond of Python shows."""
    if not available():
        return {}
    lib = load_kernel()
    return {torch.float32: (lib.rms_norm_f32, lib.rope_f32),
            torch.bfloat16: (lib.rms_norm_bf16, lib.rope_bf16)}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over the last dim of x [..., n] (rows evenly strided) with weight [n]; None when
    the kernel does not apply."""
    fns = _functions().get(x.dtype)
    if (fns is None or weight.dtype != x.dtype or not x.is_cpu or not weight.is_cpu
            or x.stride(-1) != 1 or not weight.is_contiguous()):
        return None
    n = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, n)
    if rows.shape[0] > 1 and rows.stride(0) < n:
        return None  # rows overlap: not a layout a row stride describes
    out = torch.empty(x.shape, dtype=x.dtype)
    fns[0](rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), rows.shape[0], n,
           eps, torch.get_num_threads())
    return out


def rope(positions: torch.Tensor, x: torch.Tensor,
         cos_sin_cache: torch.Tensor) -> torch.Tensor | None:
    """Neox-style RoPE of x [T, H, D] at `positions` [T] (int64), from the shared cache
    [max_position, D] in x's dtype (cos in its first D / 2 columns, sin in the rest): a new
    contiguous [T, H, D]. None when the kernel does not apply."""
    fns = _functions().get(x.dtype)
    if (fns is None or not x.is_cpu or x.dim() != 3 or x.stride(-1) != 1
            or positions.dtype != torch.int64 or not positions.is_contiguous()
            or cos_sin_cache.dtype != x.dtype or cos_sin_cache.dim() != 2
            or cos_sin_cache.shape[-1] != x.shape[-1] or cos_sin_cache.stride(-1) != 1):
        return None
    tokens, heads, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype)
    max_position = cos_sin_cache.shape[0]
    rc = fns[1](x.data_ptr(), x.stride(0), x.stride(1), out.data_ptr(), positions.data_ptr(),
                cos_sin_cache.data_ptr(), cos_sin_cache.stride(0), max_position, tokens, heads,
                dim // 2, torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"a position is outside the rotary cache's {max_position}")
    return out
