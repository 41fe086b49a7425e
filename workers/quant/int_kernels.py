"""int8 and int4 weights times int8 activations on the CPU (`workers/csrc/int_gemm.c`: AVX-512
VNNI byte dot products, activations quantized in blocks of 32 columns). `available()` says
whether this CPU and compiler run them; without them the quantized layers use torch's kernels.
`block_int8` / `block_int4` lay the weights out as the kernels read them."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from workers.native import build_library, loads

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parents[1] / "csrc" / "int_gemm.c"


@functools.lru_cache(maxsize=None)
def load_kernel() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE)))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.int8_gemm.argtypes = [ptr, i32, ptr, ptr, ptr, i32, i64, i64, i64, i32]
    lib.int4_gemm.argtypes = [ptr, i32, ptr, ptr, i32, ptr, ptr, i32, i64, i64, i64, i64, i32]
    lib.int8_gemm.restype = lib.int4_gemm.restype = lib.int_gemm_available.restype = i32
    return lib


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the kernels build here and the CPU has AVX-512 VNNI."""
    return (loads(load_kernel, "the int8/int4 CPU kernels are unavailable, using torch's", logger)
            and bool(load_kernel().int_gemm_available()))


def _check(rc: int, what: str) -> None:
    if rc == -1:
        raise RuntimeError("the int8/int4 kernels need AVX-512 VNNI, which this CPU lacks")
    if rc == -2:
        raise ValueError(f"{what}: unsupported shape")
    if rc != 0:
        raise MemoryError(f"{what}: out of memory")


def block_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 q [N, K] (K a multiple of 64) -> the kernel's layout, flat uint8 (q + 128): each
    tile of 4 rows (the last padded with zero rows) as K / 64 runs of its 4 rows' next 64
    columns."""
    n, k = q.shape
    u = (torch.nn.functional.pad(q.to(torch.int16), (0, 0, 0, -n % 4)) + 128).to(torch.uint8)
    return u.view(-1, 4, k // 64, 64).transpose(1, 2).contiguous().view(-1)


_DTYPES = (torch.float32, torch.bfloat16)  # of x and of the output: fp32, or bf16 (flag 1)


def _activations(x: torch.Tensor) -> torch.Tensor:
    return (x if x.dtype in _DTYPES else x.float()).contiguous()


def int8_gemm(x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor,
              num_threads: int | None = None, out_dtype: torch.dtype = torch.float32
              ) -> torch.Tensor:
    """x [M, K] (fp32 or bf16; others are cast to fp32) times the int8 weight [N, K] given
    `block_int8`-blocked, with fp32 `scales` [N] -> [M, N] in `out_dtype` (fp32 or bf16, the
    fp32 result rounded to nearest even as torch rounds)."""
    m, k = x.shape
    n = scales.shape[0]
    x = _activations(x)
    out = torch.empty(m, n, dtype=out_dtype)
    _check(load_kernel().int8_gemm(x.data_ptr(), _DTYPES.index(x.dtype), blocked.data_ptr(),
                                   scales.data_ptr(), out.data_ptr(), _DTYPES.index(out_dtype),
                                   m, n, k, num_threads or torch.get_num_threads()),
           "int8_gemm")
    return out


def block_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Signed int4 q [N, K] (K a multiple of 32) with per-group fp32 scales and zeros [N, G]
    -> the kernel's (weights, scales, offsets): tiles of 4 rows (the last padded with zero
    rows), each 32 columns as 4 runs of 16 bytes (byte i: column i + 8 in the low nibble,
    column i + 16 + 8 in the high one), scales and offsets (8 + zero) * scale as [tiles, G, 4]
    (offsets None when every zero is 0: the kernel then takes 8 * scale itself). The scales are
    bf16 when every one is a bf16 value (as compressed-tensors stores them): the same numbers in
    half the bytes; else fp32.
    """
    n, k = q.shape
    pad = -n % 4
    u = torch.nn.functional.pad(q.to(torch.int16) + 8, (0, 0, 0, pad)).to(torch.uint8)
    u = u.view(-1, 4, k // 32, 2, 16)
    packed = (u[:, :, :, 0] | (u[:, :, :, 1] << 4)).transpose(1, 2).contiguous().view(-1)

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t.float(), (0, 0, 0, pad))
        return t.view(-1, 4, t.shape[1]).transpose(1, 2).contiguous().view(-1)

    offsets = per_tile((8 + zeros) * scales) if bool(zeros.any()) else None
    scales = per_tile(scales)
    as_bf16 = scales.to(torch.bfloat16)
    return packed, as_bf16 if torch.equal(as_bf16.float(), scales) else scales, offsets


def int4_gemm(x: torch.Tensor,
              blocked: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
              n: int, group: int, num_threads: int | None = None,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] (as `int8_gemm`'s) times the [n, K] int4 weight `block_int4` made, in groups of
    `group` columns -> [M, n] in `out_dtype` (fp32 or bf16)."""
    m, k = x.shape
    x = _activations(x)
    packed, scales, offsets = blocked
    out = torch.empty(m, n, dtype=out_dtype)
    _check(load_kernel().int4_gemm(x.data_ptr(), _DTYPES.index(x.dtype), packed.data_ptr(),
                                   scales.data_ptr(), int(scales.dtype == torch.bfloat16),
                                   None if offsets is None else offsets.data_ptr(),
                                   out.data_ptr(),
                                   _DTYPES.index(out_dtype), m, n, k, group,
                                   num_threads or torch.get_num_threads()), "int4_gemm")
    return out
