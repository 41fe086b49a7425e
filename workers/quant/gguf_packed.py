"""Layers whose weights stay GGUF Q8_0 / Q4_0 / Q4_1 blocks on the CPU, as the file stores them.

`pack_layer` runs on a freshly built model before its GGUF file is read: the layer's `weight`
becomes a uint8 parameter [N, K / 32 * block bytes] (each row its blocks, as in the file; the
layer's own weight loader fills it, since the loaders place rows by `param.shape[1:]`), and
its `matmul` (or, for an embedding table, its `lookup`) reads those blocks
(`workers.kernels.gguf_gemm`). A tied output projection shares the embedding's packed table.

Kernels: up to `DECODE_ROWS` rows of x (a decode step's), the block kernel, which reads the
weight once for all rows; more (a prefill's), the weight dequantized a tile of rows at a time
and torch's fp32 matmul. Both give dequantize-then-matmul's result up to the order of fp32 sums.
Compared in `benchmarks/gguf_packed.py` with the weights dequantized at load. With
`EngineConfig.fp32_int_kernels`, `use_int_kernels` then moves them to `GGUFVnniMatmul`
(`workers.kernels.gguf_vnni`: the same values, activations quantized to int8).
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from torch import nn

from workers.kernels import gguf_gemm as gguf_kernels
from workers.kernels import gguf_vnni

PACKED_TYPES = tuple(gguf_kernels.TYPES)  # the GGML types kept packed
# up to this many rows, the block kernel (its time grows with each row); more,
# dequantize-to-tile and torch's matmul. SmolLM2's own weights, best of 5 on this 2-core
# machine, tiled's time over the block kernel's at 8 / 16 / 32 / 64 / 128 rows: gate (1536 x
# 576, Q4_1) 2.72 / 3.24 / 2.18 / 0.75 / 0.52, down 2.83 / 3.31 / 1.94 / 0.79 / 0.60, the
# output projection (49152 x 576, Q8_0) 3.35 / 3.67 / 1.83 / 0.76 / 0.51
DECODE_ROWS = 32


def packable(module: Any, ggml_type: str) -> bool:
    """Whether `module` (a linear layer or a vocabulary table, unsharded, not already given a
    kernel) can hold `ggml_type` blocks."""
    weight = getattr(module, "weight", None)
    return (ggml_type in PACKED_TYPES and isinstance(weight, nn.Parameter)
            and weight.dim() == 2 and weight.shape[1] % gguf_kernels.BLOCK == 0
            and getattr(module, "tp_size", 1) == 1 and getattr(module, "matmul", None) is None
            and gguf_kernels.available())


def pack_layer(module: Any, ggml_type: str, dtype: torch.dtype) -> None:
    """Trades `module.weight` [N, K] for a uint8 one [N, row bytes] its loader fills with the
    file's blocks; gives the layer `GGUFMatmul` (a linear layer, an output projection) or
    `GGUFLookup` (an input embedding: anything with `num_embeddings` and no `compute_logits`).
    `dtype`: the model's activations, which the kernels return."""
    if not packable(module, ggml_type):
        raise ValueError(f"{type(module).__name__} cannot hold {ggml_type} blocks (packed "
                         f"types {list(PACKED_TYPES)}, K a multiple of "
                         f"{gguf_kernels.BLOCK}, one rank)")
    n, k = module.weight.shape
    loader = module.weight.weight_loader
    packed = nn.Parameter(torch.empty(n, gguf_kernels.row_bytes(ggml_type, k),
                                      dtype=torch.uint8), requires_grad=False)
    packed.weight_loader = loader  # type: ignore[attr-defined]  # as every parameter's
    del module.weight
    module.weight = packed
    if hasattr(module, "num_embeddings") and not hasattr(module, "compute_logits"):
        module.lookup = GGUFLookup(ggml_type, k, dtype)
    else:
        module.matmul = GGUFMatmul(ggml_type, n, k)


def quantize_layer(module: Any, ggml_type: str, dtype: torch.dtype) -> None:
    """Holds `module`'s full-precision weight [N, K] as `ggml_type` blocks quantized here as
    llama.cpp quantizes (the `gguf` package's quantizer): `pack_layer`'s layer once its file is
    read. A weight dequantized from such blocks is held again exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weight = module.weight.detach().float().cpu().numpy()
    blocks = torch.from_numpy(quantize(weight, GGMLQuantizationType[ggml_type]))
    pack_layer(module, ggml_type, dtype)
    with torch.no_grad():
        module.weight.copy_(blocks)


def tie_packed(lm_head: Any, embedding: Any) -> None:
    """Points a tied output projection at the embedding's packed table (`pack_layer` replaced
    the parameter they shared)."""
    lookup = embedding.lookup
    if not isinstance(lookup, GGUFLookup):
        raise ValueError(f"the embedding holds no packed table (lookup {lookup!r})")
    del lm_head.weight
    lm_head.weight = embedding.weight
    lm_head.matmul = GGUFMatmul(lookup.ggml_type, embedding.weight.shape[0], lookup.k)


class _BlocksMatmul(abc.ABC):
    """y = x W^T for a layer whose W is a GGUF file's blocks, by a kernel of `_product`'s: x
    [T, K] -> [T, N] in out_dtype (default x's), fp32 inside."""

    # the fused decoder layers and `small_gemm.PackedMLP` may call its kernel from C
    c_callable = True

    def __init__(self, ggml_type: str, out_features: int, in_features: int) -> None:
        self.ggml_type, self.out_features, self.in_features = (
            ggml_type, out_features, in_features)

    def __call__(self, module: Any, x: torch.Tensor,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = self._product(module, x)
        out_dtype = out_dtype or x.dtype
        return y if y.dtype == out_dtype else y.to(out_dtype)

    @abc.abstractmethod
    def _product(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """x W^T in fp32, by the subclass's kernel."""


class GGUFMatmul(_BlocksMatmul):
    """The blocks as the file stores them (`weight`: uint8 [N, row bytes])."""

    def _product(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if x.shape[0] <= DECODE_ROWS:
            return gguf_kernels.gguf_gemm(x, w, self.ggml_type, self.out_features)
        return gguf_kernels.tiled_mm(x, w, self.ggml_type, self.out_features)


class GGUFLookup:
    """Rows of an embedding table held as GGUF blocks, dequantized as they are looked up."""

    def __init__(self, ggml_type: str, k: int, dtype: torch.dtype) -> None:
        self.ggml_type, self.k, self.dtype = ggml_type, k, dtype

    def __call__(self, module: Any, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, k] in the model's dtype
        rows = gguf_kernels.dequantize_rows(module.weight, self.ggml_type, self.k,
                                            ids=input_ids.reshape(-1))
        rows = rows.view(*input_ids.shape, self.k)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)


class GGUFVnniMatmul(_BlocksMatmul):
    """The blocks moved to the VNNI kernel (`use_int_kernels`): `qweight`, `scales` and
    `offsets` as `gguf_vnni.block_gguf` lays them out, any number of rows of x."""

    def _product(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        return gguf_vnni.gguf_vnni_gemm(x, (module.qweight, module.scales, module.offsets),
                                        self.ggml_type, self.out_features)


def use_int_kernels(model: nn.Module) -> int:
    """Moves every packed GGUF matmul of `model` (after loading; a tied output projection too,
    with a copy of the table laid out for it) onto the VNNI kernel (`EngineConfig.
    fp32_int_kernels`): the file's values exactly, activations quantized to int8 in blocks of
    32 columns (as llama.cpp multiplies them); the fused decoder stack takes them. Returns how
    many moved; none without AVX-512 VNNI."""
    if not gguf_vnni.available():
        return 0
    moved = 0
    with torch.no_grad():
        for module in model.modules():  # typed Any: a layer's attributes are set at load
            layer: Any = module
            matmul = getattr(layer, "matmul", None)
            if not isinstance(matmul, GGUFMatmul):
                continue
            parts = gguf_vnni.block_gguf(layer.weight.data, matmul.ggml_type,
                                         matmul.in_features)
            if not getattr(layer, "tied", False):
                del layer.weight  # a tied head's is the embedding table, still looked up
            for name, value in zip(("qweight", "scales", "offsets"), parts, strict=True):
                layer.register_buffer(name, value)
            layer.matmul = GGUFVnniMatmul(matmul.ggml_type, matmul.out_features,
                                          matmul.in_features)
            moved += 1
    return moved
