"""int8 and int4 weights times int8 activations on the CPU (`workers/kernels/csrc/int_gemm.c`:
AVX-512 VNNI byte dot products, activations quantized in blocks of 32 columns). `available()` says
whether this CPU and compiler run them; without them the quantized layers use torch's kernels.
`block_int8` / `block_int4` lay the weights out as the kernels read them."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from collections.abc import Callable

import torch

from workers.kernels.native import build_library, loads

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "int_gemm.c"
DEQUANT_SOURCE = Path(__file__).parent / "csrc" / "int_dequant.c"


@functools.cache
def load_kernel() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE)))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.int8_gemm.argtypes = [ptr, i32, ptr, ptr, ptr, i32, i64, i64, i64, i32]
    lib.int4_gemm.argtypes = [ptr, i32, ptr, ptr, i32, ptr, ptr, i32, i64, i64, i64, i64, i32]
    lib.int8_gemm.restype = lib.int4_gemm.restype = lib.int_gemm_available.restype = i32
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernels build here and the CPU has AVX-512 VNNI."""
    return (loads(load_kernel, "the int8/int4 CPU kernels are unavailable, using torch's", logger)
            and bool(load_kernel().int_gemm_available()))


@functools.cache
def load_dequant() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(DEQUANT_SOURCE)))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.int8_to_bf16.argtypes = [ptr, i64, i64, i64, i64, ptr, i32]
    lib.int4_to_bf16.argtypes = [ptr, ptr, i32, ptr, i64, i64, i64, i64, i64, ptr, i32]
    lib.int8_to_bf16.restype = lib.int4_to_bf16.restype = i32
    lib.int_dequant_available.restype = i32
    return lib


@functools.cache
def dequant_available() -> bool:
    """Whether the weights can be unpacked to bf16 here (AVX-512 BF16) and torch's bf16 matmul
    has AMX tiles to run on. Without AMX, oneDNN's bf16 matmul was not measured against the
    VNNI kernels, so those keep every row there."""
    return (available() and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and _cpu_has("amx_bf16")
            and loads(load_dequant, "bf16 unpacking of int8/int4 weights is unavailable", logger)
            and bool(load_dequant().int_dequant_available()))


def _cpu_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


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


def unpack_int8(blocked: torch.Tensor, n: int, k: int, start: int = 0, end: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [start, end) (start a multiple of 4) of the [n, k] int8 weight `block_int8` made
    -> their values q as bf16 [end - start, k] (exact), into `out` when given."""
    end = n if end is None else end
    out = torch.empty(end - start, k, dtype=torch.bfloat16) if out is None else out
    _check(load_dequant().int8_to_bf16(blocked.data_ptr(), n, k, start, end, out.data_ptr(),
                                       torch.get_num_threads()), "unpack_int8")
    return out


def unpack_int4(blocked: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], n: int,
                k: int, group: int, start: int = 0, end: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [start, end) (start a multiple of 4) of the [n, k] int4 weight `block_int4` made
    -> (q - z) s per group, rounded to bf16 [end - start, k], into `out` when given."""
    end = n if end is None else end
    packed, scales, offsets = blocked
    out = torch.empty(end - start, k, dtype=torch.bfloat16) if out is None else out
    _check(load_dequant().int4_to_bf16(packed.data_ptr(), scales.data_ptr(),
                                       int(scales.dtype == torch.bfloat16),
                                       None if offsets is None else offsets.data_ptr(),
                                       n, k, group, start, end, out.data_ptr(),
                                       torch.get_num_threads()), "unpack_int4")
    return out


# the unpacked bf16 weight rows one bf16 matmul takes: up to this, a layer's whole weight (the
# `small` preset's largest, its 8192 x 512 lm_head, is 8 MB); past it, chunks of rows, so a 0.6B
# model's 11264 x 2048 gate/up (46 MB) does not map fresh pages from the OS every call
# (glibc's malloc returns buffers over 32 MB to it: 23 ms, twice the matmul, measured here)
UNPACK_CHUNK_BYTES = 8 << 20


def unpacked_mm(x: torch.Tensor, unpack: Callable[..., torch.Tensor], n: int, k: int,
                scales: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k] times the [n, k] weight `unpack(start, end, out=)` gives as bf16 rows (a
    `functools.partial` of `unpack_int8` / `unpack_int4`), by oneDNN's bf16 matmul (AMX
    tiles) -> fp32 [M, n], times the per-row `scales` [n] when given. x is rounded to bf16,
    and so is each output (torch's CPU matmul gives bf16 x bf16 in bf16 only), then widened."""
    xb = x.to(torch.bfloat16).contiguous()
    rows = max(64, UNPACK_CHUNK_BYTES // (2 * k) // 64 * 64)
    if rows >= n:
        y = torch.nn.functional.linear(xb, unpack(0, n)).float()
        return y if scales is None else y.mul_(scales)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    buf = torch.empty(rows, k, dtype=torch.bfloat16)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        part = torch.nn.functional.linear(xb, unpack(start, end, out=buf[:end - start]))
        if scales is None:
            y[:, start:end].copy_(part)
        else:
            torch.mul(part, scales[start:end], out=y[:, start:end])
    return y
