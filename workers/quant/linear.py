"""Linear layers that keep their weights quantized, and the kernels that multiply by them.

`quantize_layers` runs on a freshly built model before its checkpoint is read: every linear
layer (and the output projection, when the checkpoint quantizes it) whose weight this device
and dtype can multiply in quantized form trades its `weight` parameter for `qweight` (int8
[N, K]), `scales` and `zeros` ([N, K / group]) of this rank's shard, loaded by the layer's own
(sharding) weight loader. Every other quantized tensor is
dequantized while it is read (`workers.quant.decode`), so the layer stays a plain one.
After loading, `prepare_layers` packs each kept weight for its kernel.

Kernels (CPU, bf16 or fp16 activations; fp32 too by the VNNI kernels when the engine asks,
`EngineConfig.fp32_int_kernels`): int8 with one scale per output channel and int4 in
groups of 32-256 input columns, by Cleave's VNNI kernels or torch's (`QuantizedMatmul`). fp32
activations, GPUs and other layouts get the dequantized weight (measured in
`benchmarks/quantized_decode.py`; GPU kernels are not built yet).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol
from collections.abc import Callable, Iterator

import torch
from torch import nn

from workers.kernels import int_gemm as int_kernels
from workers.quant.scheme import QuantScheme

INT4_GROUPS = (32, 64, 128, 256)
# from this many rows on, int8 weights multiply int8 activations (`torch._int_mm`): the
# weight-only kernel's time grows with each row, the int8 matmul's barely (measured here:
# 1.2 vs 2.3 ms at 16 rows of a 2048 x 5632 weight, bf16 1.4 ms)
INT8_ACTIVATION_ROWS = 8
# from this many rows on, a layer packed for the VNNI kernels unpacks its weight to bf16 and runs
# oneDNN's bf16 matmul (AMX) instead (`int_kernels.unpacked_mm`), by kernel: measured on one
# thread (`benchmarks/int_many_rows.py`), int4 is even at 16-24 rows and ahead by 1.0-1.7x at
# 32 on the `small` preset's and a 0.6B model's shapes; int8 (the faster VNNI kernel) is
# 0.8-1.2x at 32 rows, 1.0-1.9x at 64
UNPACK_ROWS = {"int8": 64, "int4": 32}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def kernel_for(scheme: QuantScheme, dtype: torch.dtype, device: torch.device,
               in_features: int, fp32: bool = False) -> str | None:
    """The kernel that multiplies by `scheme`'s weights here, None when none does. `fp32`:
    fp32 activations too, where Cleave's VNNI kernels run (torch's take bf16 only)."""
    if scheme.kind != "int" or scheme.act_order or device.type != "cpu":
        return None
    fp32 = fp32 and dtype == torch.float32 and int_kernels.available()
    if dtype not in (torch.bfloat16, torch.float16) and not fp32:
        return None
    if fp32 and in_features % (64 if scheme.bits == 8 else 32):
        return None  # torch's kernels would run it, in bf16
    if scheme.bits == 8 and scheme.group_size is None:
        return "int8"
    if scheme.bits == 4 and scheme.group_size in INT4_GROUPS \
            and in_features % scheme.group_size == 0:
        return "int4"
    return None


class QuantizableModel(Protocol):
    """A model as `quantize_layers` reads it (every family: `LlamaForCausalLM`'s)."""

    def map_name(self, hf_name: str) -> tuple[str, object]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


def checkpoint_names(model: QuantizableModel, name: str) -> list[str]:
    """The checkpoint modules fused into our module `name` (itself when not fused)."""
    parent, _, leaf = name.rpartition(".")
    parts = [f"{parent}.{p}" for p in _FUSED.get(leaf, ())]
    mapped = [p for p in parts if model.map_name(p + ".weight")[0] == name + ".weight"]
    return mapped or [name]


def quantize_layers(model: QuantizableModel, scheme: QuantScheme, dtype: torch.dtype,
                    device: torch.device, linear_types: tuple[type, ...],
                    fp32: bool = False) -> set[str]:
    """Gives each linear layer a kernel can serve quantized params in place of its weight
    (`fp32`: in fp32 too, by the VNNI kernels; `kernel_for`).

    Returns the checkpoint module names kept quantized; the loader dequantizes the rest.
    """
    kept: set[str] = set()
    dense = set(getattr(model, "dense_after_load", ()))
    for name, module in list(model.named_modules()):
        if not isinstance(module, linear_types) or name.rpartition(".")[2] in dense:
            continue
        layer: Any = module  # one of `linear_types`, whose attributes nn.Module cannot name
        names = checkpoint_names(model, name)
        quantized = [scheme.quantizes(n) for n in names]
        if all(quantized) and getattr(layer, "tied", False):
            raise ValueError(f"{name!r} is tied to the input embedding (tie_word_embeddings) "
                             "but the quantization config quantizes it; expected an untied "
                             "model or a full-precision lm_head")
        if any(quantized) and not all(quantized):
            raise ValueError(f"{names} are fused into one layer but the quantization config "
                             "skips only some of them; expected all or none")
        in_features = layer.weight.shape[1]
        module_scheme = scheme.for_module(names[0])
        kernel = kernel_for(module_scheme, dtype, device, in_features, fp32) \
            if all(quantized) else None
        if kernel is None:
            continue
        _swap(layer, module_scheme, kernel)
        kept.update(names)
    return kept


def _swap(module: Any, scheme: QuantScheme, kernel: str) -> None:
    """`module`: a linear layer (its `weight` and `matmul`)."""
    n, k = module.weight.shape
    groups = k // (scheme.group_size or k)
    loader: Callable[..., None] = module.weight.weight_loader
    del module.weight
    for pname, shape, dtype in (("qweight", (n, k), torch.int8),
                                ("scales", (n, groups), torch.float32),
                                ("zeros", (n, groups), torch.float32)):
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        # a parameter carries its loader as an attribute of its own (as vLLM's do)
        param.weight_loader = loader  # type: ignore[attr-defined]  # an attribute of our own
        module.register_parameter(pname, param)
    module.matmul = QuantizedMatmul(kernel)


class PackedLayer(Protocol):
    """The buffers `QuantizedMatmul.pack` registers on its layer (which ones: by kernel)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    scales_f32: torch.Tensor
    zero_terms: torch.Tensor
    offsets: torch.Tensor
    scale_zero: torch.Tensor


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    t = getattr(module, name)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is a {type(t).__name__}; expected a "
                        "tensor")
    return t


class QuantizedMatmul:
    """y = x W^T for a layer whose W is held packed; `pack` runs once, after loading.

    With AVX-512 VNNI (`workers.kernels.int_gemm`) the weights are blocked for Cleave's own
    kernels, activations quantized to int8 in blocks of 32 columns (one row, a 0.6B model's
    weights out of cache: int8 2.7x torch's weight-only kernel, int4 1.4x; in cache 2.0x and
    1.7x). Those take 4 rows of x per pass and are compute-bound past a few rows (50-90 GMAC/s
    on 2 cores), so from `UNPACK_ROWS` rows (a prefill's; int4: 32 decode streams') the weight is
    unpacked to bf16 (in chunks) and oneDNN's bf16 matmul runs it on AMX tiles
    (`int_kernels.unpacked_mm`; where the CPU lacks AMX or AVX-512 BF16 the VNNI kernels keep
    every row). bf16 activations rather than `torch._int_mm`'s per-row int8 ones, for int8
    too: `_int_mm` alone is 1.1-1.5x the bf16 matmul at 128 rows (one thread, measured here),
    but it needs x quantized and the weight unblocked to int8 all the same, and per-row int8 is
    the least accurate of the three (an int8 1024 x 1408 layer, 128 rows with 8 outlier
    columns x20: relative error bf16 2.4e-3, the VNNI kernels' 32-column blocks 7.3e-3, per-row
    int8 4.6e-2). The decode step's few rows stay
    on the VNNI kernels (and the fused decoder stack's C, `workers.models.fused_layer`).
    Otherwise torch's: int8 weight-only below `INT8_ACTIVATION_ROWS` rows and `torch._int_mm`
    from there, int4 weight-only (tinygemm).
    """

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        self.vnni = False
        self.unpack_rows: int | None = None  # rows from which `_unpacked` runs; None: never

    def pack(self, module: nn.Module) -> None:
        q, scales, zeros = (_tensor(module, n).data for n in ("qweight", "scales", "zeros"))
        del module.qweight, module.scales, module.zeros
        self.out_features, k = q.shape
        self.group_size = k // scales.shape[1]
        self.has_zeros = bool(zeros.any())
        if self.kernel == "int8":
            module.register_buffer("scales_f32", scales[:, 0].float().contiguous())
            module.register_buffer("zero_terms", (zeros[:, 0] * scales[:, 0]).float()
                                   if self.has_zeros else None)
        self.vnni = int_kernels.available() and (
            k % 64 == 0 if self.kernel == "int8" else k % 32 == 0 and self.group_size % 32 == 0)
        self.unpack_rows = UNPACK_ROWS[self.kernel] \
            if self.vnni and int_kernels.dequant_available() else None
        if self.vnni and self.kernel == "int8":
            module.register_buffer("qweight", int_kernels.block_int8(q))
        elif self.vnni:
            packed, block_scales, offsets = int_kernels.block_int4(q, scales, zeros)
            module.register_buffer("qweight", packed)
            module.register_buffer("scales", block_scales)
            module.register_buffer("offsets", offsets)
        elif self.kernel == "int8":
            module.register_buffer("qweight", q.contiguous())
            module.register_buffer("scales", scales[:, 0].to(torch.bfloat16).contiguous())
        else:
            unsigned = (q.to(torch.int32) + 8).contiguous()
            module.register_buffer(
                "qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1))
            # tinygemm's form: w = (u - 8) * scale + zero, so zero = -z * scale
            scale_zero = torch.stack([scales.t(), (-zeros * scales).t()], dim=-1)
            module.register_buffer("scale_zero", scale_zero.to(torch.bfloat16).contiguous())

    @property
    def c_callable(self) -> bool:
        """Packed for the VNNI kernels with nothing left to torch (int8 zero points are
        subtracted in torch), so the fused decoder layers and `small_gemm.PackedMLP` may take
        it."""
        return self.vnni and not (self.kernel == "int8" and self.has_zeros)

    def __call__(self, module: PackedLayer, x: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # x: [T, K] -> [T, N] in out_dtype (default x's)
        out_dtype = out_dtype or x.dtype
        zero_terms = self.has_zeros and self.kernel == "int8"
        if self.unpack_rows is not None and x.shape[0] >= self.unpack_rows:
            y = self._unpacked(module, x)
        elif self.vnni:  # bf16 in and out without a cast (the kernels read and round bf16)
            y_dtype = out_dtype if out_dtype == torch.bfloat16 and not zero_terms \
                else torch.float32
            y = (int_kernels.int8_gemm(x, module.qweight, module.scales_f32, out_dtype=y_dtype)
                 if self.kernel == "int8"
                 else int_kernels.int4_gemm(x, (module.qweight, module.scales, module.offsets),
                                            self.out_features, self.group_size,
                                            out_dtype=y_dtype))
        else:
            y = self._torch_kernels(module, x)
        if zero_terms:
            y = y - x.float().sum(-1, keepdim=True) * module.zero_terms
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def _unpacked(self, module: PackedLayer, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, x.shape[1]
        if self.kernel == "int8":
            unpack = functools.partial(int_kernels.unpack_int8, module.qweight, n, k)
            return int_kernels.unpacked_mm(x, unpack, n, k, module.scales_f32)
        blocked = (module.qweight, module.scales, module.offsets)
        unpack = functools.partial(int_kernels.unpack_int4, blocked, n, k, self.group_size)
        return int_kernels.unpacked_mm(x, unpack, n, k)

    def _torch_kernels(self, module: PackedLayer, x: torch.Tensor) -> torch.Tensor:
        xb = (x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)).contiguous()
        if self.kernel == "int8" and x.shape[0] >= INT8_ACTIVATION_ROWS:
            return _int8_activations_mm(xb, module.qweight, module.scales_f32)
        if self.kernel == "int8":
            return torch.ops.aten._weight_int8pack_mm(xb, module.qweight, module.scales).float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, module.qweight, self.group_size, module.scale_zero)


def _int8_activations_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor
                         ) -> torch.Tensor:
    """x [M, K] (bf16) times int8 q [N, K] with activations quantized per token to int8 (as
    llama.cpp's Q8_0 does): one int8 x int8 -> int32 matmul, then both scales. fp32 [M, N]."""
    xf = x.float()
    x_scales = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
    xq = torch.round(xf / x_scales).to(torch.int8)
    return torch._int_mm(xq, q.t()).float() * x_scales * scales


def prepare_layers(model: nn.Module) -> None:
    """Packs every kept quantized weight for its kernel (after the checkpoint is loaded)."""
    with torch.no_grad():
        for module in model.modules():
            matmul = getattr(module, "matmul", None)
            if isinstance(matmul, QuantizedMatmul):
                matmul.pack(module)
