"""GGUF's Q8_0, Q4_0 and Q4_1 weights on the CPU as the file stores them
(`workers/kernels/csrc/gguf_gemm.c`): a few fp32 rows times the packed blocks (`gguf_gemm`), and
rows dequantized to fp32 (`dequantize_rows`: an embedding lookup; `tiled_mm`: a prefill's
matmul, the weight dequantized a tile of rows at a time into one reused buffer, then torch's
fp32 matmul). A weight is uint8 [N, K / 32 * block bytes]: each row its blocks, as in the file.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from workers.kernels.native import build_library, loads

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "gguf_gemm.c"
# GGML type name -> (the kernel's type id, bytes per block of 32 columns)
TYPES = {"Q8_0": (0, 34), "Q4_0": (1, 18), "Q4_1": (2, 20)}
BLOCK = 32  # columns per block
# rows of the weight one tile of `tiled_mm` dequantizes (fp32): 4 MB at K = 576, so the tile
# stays in the cache levels the matmul reads it from
TILE_BYTES = 4 << 20


@functools.cache
def load_kernel() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE)))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gguf_gemm.argtypes = [ptr, ptr, i32, ptr, i64, i64, i64, i32]
    lib.gguf_dequant.argtypes = [ptr, i32, i64, ptr, i64, i64, ptr, i32]
    lib.gguf_gemm.restype = lib.gguf_dequant.restype = i32
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernels build and load here (any x86 or other CPU: the C loop is portable)."""
    return loads(load_kernel, "the GGUF block kernels are unavailable", logger)


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of one packed row of `k` columns."""
    if ggml_type not in TYPES:
        raise ValueError(f"GGUF type {ggml_type!r} is not kept packed; expected one of "
                         f"{list(TYPES)}")
    if k % BLOCK:
        raise ValueError(f"a {ggml_type} row has a multiple of {BLOCK} columns, got {k}")
    return k // BLOCK * TYPES[ggml_type][1]


def _check(rc: int, what: str) -> None:
    if rc == -2:
        raise ValueError(f"{what}: unsupported type or shape")
    if rc != 0:
        raise MemoryError(f"{what}: out of memory")


def gguf_gemm(x: torch.Tensor, w: torch.Tensor, ggml_type: str, n: int,
              num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] (cast to fp32) times the packed weight w [n, row_bytes] -> fp32 [M, n]."""
    m, k = x.shape
    x = x.float().contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    _check(load_kernel().gguf_gemm(x.data_ptr(), w.data_ptr(), TYPES[ggml_type][0],
                                   out.data_ptr(), m, n, k,
                                   num_threads or torch.get_num_threads()), "gguf_gemm")
    return out


def dequantize_rows(w: torch.Tensor, ggml_type: str, k: int, ids: torch.Tensor | None = None,
                    start: int = 0, end: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of the packed weight w [N, row_bytes] as fp32 [rows, k], the file's values: rows
    `ids` (int64, each checked in [0, N)) when given, else rows [start, end); into `out` when
    given."""
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < w.shape[0]):
            raise IndexError(f"row ids must be in [0, {w.shape[0]}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
        count = ids.numel()
    else:
        end = w.shape[0] if end is None else end
        count = end - start
    out = torch.empty(count, k, dtype=torch.float32) if out is None else out
    _check(load_kernel().gguf_dequant(w.data_ptr(), TYPES[ggml_type][0], k,
                                      None if ids is None else ids.data_ptr(), start, count,
                                      out.data_ptr(), torch.get_num_threads()),
           "gguf_dequant")
    return out


def tiled_mm(x: torch.Tensor, w: torch.Tensor, ggml_type: str, n: int) -> torch.Tensor:
    """x [M, K] times the packed weight w [n, row_bytes] by torch's fp32 matmul, the weight
    dequantized a tile of rows at a time (`TILE_BYTES`) -> fp32 [M, n]."""
    k = x.shape[1]
    x = x.float()
    rows = max(16, TILE_BYTES // (4 * k))
    if rows >= n:
        return x @ dequantize_rows(w, ggml_type, k).t()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    buf = torch.empty(rows, k, dtype=torch.float32)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        tile = dequantize_rows(w, ggml_type, k, start=start, end=end, out=buf[:end - start])
        torch.mm(x, tile.t(), out=y[:, start:end])
    return y
