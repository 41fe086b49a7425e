"""A step's LoRA products added to a projection's output on the CPU by the C kernel
(`csrc/small_gemm.c` `lora_add_f32`): the rows of each adapter shrunk to the stack width and
expanded again on all of torch's threads, each row of x read where it lies and each product
added in place, where the torch path gathers the rows, pads the segments for two batched
matmuls and writes the rows back (workers/models/lora/projection.py `LoraProjection.add`).

The fused decoder stack calls the same C functions inside its layers; this entry serves the
steps it does not take (a prefill, a model or step it refuses).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from workers.kernels.small_gemm import available, load_kernel


class LoraArgs(ctypes.Structure):
    """`lora_args_t` of csrc/kernels.h."""

    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("width", ctypes.c_int64),
                ("num_subs", ctypes.c_int64), ("column_ends", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("segments", ctypes.c_void_p),
                ("num_segments", ctypes.c_int64), ("num_rows", ctypes.c_int64),
                ("scratch", ctypes.c_void_p)]


@functools.cache
def _kernel() -> ctypes.CDLL:
    lib = load_kernel()
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.lora_add_f32.argtypes = [ptr, ptr, i64, i64, ctypes.POINTER(LoraArgs), ctypes.c_int]
    lib.lora_add_f32.restype = ctypes.c_int
    return lib


def takes(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether `lora_add` takes these: fp32 on the CPU, the output contiguous, and the kernel
    built here."""
    return (x.device.type == "cpu" and x.dtype == out.dtype == a.dtype == torch.float32
            and out.is_contiguous() and available())


def lora_add(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             column_ends: torch.Tensor, rows: torch.Tensor, segments: torch.Tensor,
             num_threads: int | None = None) -> torch.Tensor:
    """out[rows[i]] += (x[rows[i]] A[slot]^T) Bt[slot] for each segment (slot, first, end) of
    `segments` [S, 3] int64 and i in [first, end); A [slots, width, K], Bt [slots, width, N]
    (contiguous, fp32), whose sub j fills output columns up to `column_ends[j]` (int64) from
    stack rows j * width / len(column_ends) onwards. In place; returns `out`."""
    k, n, width = x.shape[1], out.shape[1], a.shape[1]
    if a.shape[2] != k or bt.shape[2] != n or not (a.is_contiguous() and bt.is_contiguous()):
        raise ValueError(f"lora_add: A {list(a.shape)} and Bt {list(bt.shape)} do not fit x "
                         f"{list(x.shape)} and out {list(out.shape)} (or are not contiguous)")
    x = x.contiguous()
    scratch = torch.empty(rows.shape[0] * width, dtype=torch.float32)
    args = LoraArgs(a.data_ptr(), bt.data_ptr(), width, column_ends.shape[0],
                    column_ends.data_ptr(), rows.data_ptr(), segments.data_ptr(),
                    segments.shape[0], rows.shape[0], scratch.data_ptr())
    _kernel().lora_add_f32(x.data_ptr(), out.data_ptr(), n, k, ctypes.byref(args),
                           num_threads or torch.get_num_threads())
    return out
