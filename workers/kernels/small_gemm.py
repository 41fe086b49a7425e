"""Small-batch matmuls on the CPU by a C kernel (`csrc/small_gemm.c`): a decode step's few rows
against fp32 or bf16 weights on all of torch's threads, where torch's own `linear` of one row
runs on one (MKL's sgemv). `SmallBatchMatmul` is what a dense linear layer (and the output
projection) on the CPU carries (`use_small_batch_kernel`): a few rows go through the kernel,
more through `linear`.

When, measured on this 2-core machine (`benchmarks/small_gemm.py`): fp32 weights of 0.7-46 MB,
1.7-3.7x torch's `linear` at 1 row, 2-6x at 2-8 rows; with each tile of weights read once for
all rows (the kernel's loop order since), 1.2-2.1x at 8-16 rows, 1.1-1.4x at 32, even at 48,
slower at 64 (MKL's sgemm then reaches its speed); bf16 weights (bf16
activations widened to fp32 first), 1.8-2.6x at 1 row, 1.3-1.8x at 2, even at 4, slower
beyond (oneDNN's bf16 matmul uses both cores). bf16 activations against bf16 weights use
AVX512-BF16 dot products where the CPU has them (`small_gemm_bf16_dot`): the `small` preset in
bf16 decodes one sequence in 4.8-5.1 ms a step against 6.0-6.6 widening, its int8 copy (whose
output projection stays bf16) in 3.2-3.4 against 3.4-3.7. A gated MLP whose two projections
both take the fp32 kernel takes `SmallBatchMLP` (`use_small_batch_mlp`): both matmuls and the
activation in one call.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Callable

import torch
from torch import nn

from workers.kernels.native import build_library, loads

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "small_gemm.c"
MAX_ROWS = {torch.float32: 32, torch.bfloat16: 2}  # rows through the kernel, by weight dtype
# bf16 rows through the dot-product kernel: measured against torch's bf16 `linear` (oneDNN) on
# weights of 1-8 MB out of cache, it is 1.1-2x as fast up to 8 rows, even at 16
BF16_DOT_MAX_ROWS = 8


@functools.cache
def load_kernel() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library(SOURCE)))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.small_gemm_f32, lib.small_gemm_bf16, lib.small_gemm_bf16_dot):
        fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.small_gemm_has_bf16_dot.restype = ctypes.c_int
    lib.small_mlp_f32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.small_mlp_f32.restype = ctypes.c_int
    lib.act_mul_f32.argtypes = [ptr, ptr, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.act_mul_f32.restype = ctypes.c_int
    return lib


@functools.cache
def has_bf16_dot() -> bool:
    """Whether bf16 activations times bf16 weights go through AVX512-BF16 dot products here."""
    return available() and bool(load_kernel().small_gemm_has_bf16_dot())


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads here; warns once, with the reason, when it does not."""
    return loads(load_kernel, "the small-batch matmul kernel is unavailable, using torch's "
                              "linear", logger)


def small_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
               num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] fp32 times w [N, K] (fp32 or bf16, contiguous) transposed -> [M, N] fp32."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.dtype != torch.float32 or w.dtype not in (torch.float32,
                                                                       torch.bfloat16):
        raise ValueError(f"small_gemm takes fp32 x [M, K] and fp32/bf16 w [N, K], got "
                         f"{x.dtype} {list(x.shape)} and {w.dtype} {list(w.shape)}")
    x = x.contiguous()
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    lib = load_kernel()
    fn = lib.small_gemm_f32 if w.dtype == torch.float32 else lib.small_gemm_bf16
    fn(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k,
       num_threads or torch.get_num_threads())
    return out


def small_gemm_bf16_dot(x: torch.Tensor, w: torch.Tensor,
                        num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] bf16 times w [N, K] bf16 (contiguous) transposed -> [M, N] fp32, by AVX512-BF16
    dot products (`has_bf16_dot()`)."""
    m, k = x.shape
    if w.shape[1] != k or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise ValueError(f"small_gemm_bf16_dot takes bf16 x [M, K] and bf16 w [N, K], got "
                         f"{x.dtype} {list(x.shape)} and {w.dtype} {list(w.shape)}")
    x = x.contiguous()
    out = torch.empty(m, w.shape[0], dtype=torch.float32)
    rc = load_kernel().small_gemm_bf16_dot(x.data_ptr(), w.data_ptr(), out.data_ptr(), m,
                                           w.shape[0], k, num_threads or torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("this CPU has no AVX512-BF16 dot products (has_bf16_dot() is False)")
    return out


class Weighted(Protocol):
    """A dense layer, as the kernels read it."""

    @property
    def weight(self) -> torch.Tensor: ...


class SmallBatchMatmul:
    """A dense layer's matmul on the CPU: the kernel for a few rows, `linear` for more."""

    kernel = "small_gemm"

    def __init__(self, weight_dtype: torch.dtype) -> None:
        # bf16 rows against these bf16 weights by dot products (decided once, not per call)
        self.bf16_dot = weight_dtype == torch.bfloat16 and has_bf16_dot()
        self.max_rows = BF16_DOT_MAX_ROWS if self.bf16_dot else MAX_ROWS[weight_dtype]

    def __call__(self, module: Weighted, x: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        w = module.weight
        if x.shape[0] > self.max_rows or x.dtype != w.dtype:
            y = torch.nn.functional.linear(x, w)
        elif self.bf16_dot:  # x is bf16 here: its dtype is the weight's
            y = small_gemm_bf16_dot(x, w)
        else:
            y = small_gemm(x if x.dtype == torch.float32 else x.float(), w)
        out_dtype = out_dtype or x.dtype
        return y if y.dtype == out_dtype else y.to(out_dtype)


def small_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, gelu: bool,
              num_threads: int | None = None) -> torch.Tensor:
    """A gated MLP in one kernel call: x [M, H] fp32, w_gate_up [2I, H] (gate rows, then up),
    w_down [H, I], both fp32 and contiguous -> down(act(gate) * up) [M, H] fp32; act: SiLU, or
    GELU's tanh form (`gelu`)."""
    _check_mlp(x.dtype, x.shape[-1], w_gate_up, w_down, f"x {list(x.shape)}")
    return _mlp(x, w_gate_up, w_down, gelu, num_threads)


def _check_mlp(x_dtype: torch.dtype, hidden: int, w_gate_up: torch.Tensor,
               w_down: torch.Tensor, x_desc: str) -> None:
    inter = w_down.shape[1]
    if (x_dtype != torch.float32 or w_gate_up.dtype != torch.float32
            or w_down.dtype != torch.float32 or tuple(w_gate_up.shape) != (2 * inter, hidden)
            or tuple(w_down.shape) != (hidden, inter)):
        raise ValueError(f"small_mlp takes fp32 x [M, H], w_gate_up [2I, H] and w_down [H, I], "
                         f"got {x_dtype} {x_desc}, {w_gate_up.dtype} "
                         f"{list(w_gate_up.shape)} and {w_down.dtype} {list(w_down.shape)}")
    if not (w_gate_up.is_contiguous() and w_down.is_contiguous()):
        raise ValueError("small_mlp reads its weights row by row: pass contiguous w_gate_up and "
                         "w_down")


def _mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, gelu: bool,
         num_threads: int | None = None) -> torch.Tensor:
    """`small_mlp` without its checks (operands already checked)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], w_down.shape[0], dtype=torch.float32)
    rc = load_kernel().small_mlp_f32(x.data_ptr(), w_gate_up.data_ptr(), w_down.data_ptr(),
                                     out.data_ptr(), x.shape[0], w_down.shape[0],
                                     w_down.shape[1], int(gelu),
                                     num_threads or torch.get_num_threads())
    if rc != 0:
        raise MemoryError("small_mlp could not allocate its scratch")
    return out


class SmallBatchMLP:
    """A gated MLP's few fp32 rows on the CPU in one kernel call (`small_mlp`): between its two
    matmuls nothing returns to Python. Measured on this 2-core machine (`benchmarks/small_gemm.py`,
    8 layers' weights in turn; four runs, which swing by a third here): the `small` preset's MLP
    1.03-2.0x as fast as unfused at 1-8 rows (one run of four: 0.79x at 4 rows), a 0.6B
    model's even, 0.88-1.1x (its matmuls dwarf the gap); a `small` decode step 4-8% shorter at
    1, 4 and 8 streams (paired runs of the engine). The weights are checked once, here: the call
    is on every decode step's path, and the caller (`LlamaMLP`) passes fp32 rows of its width."""

    max_rows = MAX_ROWS[torch.float32]

    def __init__(self, gate_up: Weighted, down: Weighted, gelu: bool) -> None:
        _check_mlp(torch.float32, gate_up.weight.shape[1], gate_up.weight, down.weight,
                   "rows of the layer's width")
        self.gate_up, self.down, self.gelu = gate_up, down, gelu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _mlp(x, self.gate_up.weight, self.down.weight, self.gelu)


def act_and_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up of fp32 gate_up [M, 2I] (gate columns, then up) -> [M, I], by the C code
    `small_mlp` runs between its matmuls (so the fused decoder layers round it alike)."""
    gate_up = gate_up.contiguous()
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, inter, dtype=torch.float32)
    load_kernel().act_mul_f32(gate_up.data_ptr(), out.data_ptr(), m, inter, int(gelu),
                              torch.get_num_threads())
    return out


class PackedMLP:
    """A gated MLP's few fp32 rows over int8/int4 weights packed for the VNNI kernels: gate/up,
    the activation product by `act_and_mul`, down, as the fused decoder layers
    (`workers.models.fused_layer`) run them in C, so both give the same bits."""

    max_rows = MAX_ROWS[torch.float32]

    def __init__(self, gate_up: Callable[[torch.Tensor], torch.Tensor],
                 down: Callable[[torch.Tensor], torch.Tensor], gelu: bool) -> None:
        self.gate_up, self.down, self.gelu = gate_up, down, gelu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(act_and_mul(self.gate_up(x), self.gelu))


def use_small_batch_mlp(model: nn.Module, mlp_types: tuple[type, ...]) -> int:
    """Gives every MLP of `mlp_types` whose two projections both carry `SmallBatchMatmul` over
    fp32 weights, without biases or a tensor-parallel split, the fused kernel (`SmallBatchMLP`,
    its `small_batch`); one whose projections are both VNNI-packed int8/int4, `PackedMLP`.
    Returns how many took either."""
    count = 0
    for module in model.modules():
        if not isinstance(module, mlp_types):
            continue
        mlp: Any = module  # one of `mlp_types`, which this layer below the models cannot name
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if any(p.bias is not None or p.tp_size != 1 for p in (gate_up, down)):
            continue
        if all(isinstance(p.matmul, SmallBatchMatmul) and p.weight.dtype == torch.float32
               for p in (gate_up, down)):
            mlp.small_batch = SmallBatchMLP(gate_up, down, mlp.gelu)
            count += 1
        elif all(getattr(p.matmul, "c_callable", False) for p in (gate_up, down)):
            mlp.small_batch = PackedMLP(gate_up, down, mlp.gelu)
            count += 1
    return count


def use_small_batch_kernel(model: nn.Module, layer_types: tuple[type, ...]) -> int:
    """Gives every dense CPU layer of `layer_types` with fp32 or bf16 weights the kernel (when
    it builds here). Returns how many layers took it."""
    count = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if (not isinstance(module, layer_types) or module.matmul is not None or w is None
                or w.device.type != "cpu" or w.dtype not in MAX_ROWS or not w.is_contiguous()):
            continue
        if not available():
            return 0
        module.matmul = SmallBatchMatmul(w.dtype)
        count += 1
    return count
