"""GGUF's Q8_0, Q4_0 and Q4_1 weights times int8 activations on AVX-512 VNNI
(`workers/kernels/csrc/gguf_vnni.c`): `block_gguf` lays the file's blocks out as the kernel reads
them (tiles of 16 weight rows, the same values), `gguf_vnni_gemm` multiplies any number of rows
of x by them (activations quantized to int8 in blocks of 32 columns, as llama.cpp does)."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from workers.kernels import gguf_gemm, int_gemm
from workers.kernels.native import build_library, loads

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "gguf_vnni.c"
TILE = 16  # weight rows per tile
ZERO = {"Q8_0": 128, "Q4_0": 8, "Q4_1": 0}  # w = d (u - zero) - o, u as the kernel stores it


@functools.cache
def load_kernel() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE, sources=(int_gemm.SOURCE,))))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gguf_vnni_gemm.argtypes = [ptr, ptr, ptr, ptr, i32, ptr, i64, i64, i64, i32]
    lib.gguf_vnni_gemm.restype = i32
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel builds here and the CPU has AVX-512 VNNI."""
    return (int_gemm.available()
            and loads(load_kernel, "the GGUF VNNI kernel is unavailable", logger))


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [N padded to whole tiles with zero rows, ...]."""
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, -t.shape[0] % TILE))


def block_gguf(blocks: torch.Tensor, ggml_type: str, k: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The file's blocks (uint8 [N, row bytes]) -> the kernel's (weights uint8, scales d fp16
    [tiles, K / 32, 16], offsets -m fp16 likewise, Q4_1 only): the same values."""
    n = blocks.shape[0]
    g = k // gguf_gemm.BLOCK
    b = blocks.view(n, g, gguf_gemm.TYPES[ggml_type][1])
    scales = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    offsets = None
    if ggml_type == "Q8_0":
        u = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        runs = _tiles(u).view(-1, TILE, g, 8, 4)  # operand g: columns 4g..4g+3
    else:
        nibbles = b[..., 4:] if ggml_type == "Q4_1" else b[..., 2:]
        u = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [N, G, 32]: column order
        u = _tiles(u).view(-1, TILE, g, 2, 4, 4)  # (half, run j, column in the run)
        runs = u[:, :, :, 0] | (u[:, :, :, 1] << 4)  # run j: columns 4j.. low, 16 + 4j.. high
        if ggml_type == "Q4_1":
            offsets = -b[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    weights = runs.permute(0, 2, 3, 1, 4).contiguous().view(-1)  # [tile, block, run, row, 4]

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return _tiles(t).view(-1, TILE, g).transpose(1, 2).contiguous()

    return weights, per_tile(scales), None if offsets is None else per_tile(offsets)


def gguf_vnni_gemm(x: torch.Tensor, blocked: tuple[torch.Tensor, torch.Tensor,
                                                   torch.Tensor | None],
                   ggml_type: str, n: int, num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] (cast to fp32) times the [n, K] weight `block_gguf` made -> fp32 [M, n]."""
    m, k = x.shape
    x = x.float().contiguous()
    weights, scales, offsets = blocked
    out = torch.empty(m, n, dtype=torch.float32)
    rc = load_kernel().gguf_vnni_gemm(
        x.data_ptr(), weights.data_ptr(), scales.data_ptr(),
        None if offsets is None else offsets.data_ptr(), gguf_gemm.TYPES[ggml_type][0],
        out.data_ptr(), m, n, k, num_threads or torch.get_num_threads())
    if rc == -1:
        raise RuntimeError("the GGUF VNNI kernel needs AVX-512 VNNI, which this CPU lacks")
    if rc == -2:
        raise ValueError(f"gguf_vnni_gemm: unsupported type {ggml_type} or K {k}")
    if rc != 0:
        raise MemoryError("gguf_vnni_gemm: out of memory")
    return out
