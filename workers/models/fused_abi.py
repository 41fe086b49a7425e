"""The C side of the fused decoder stack (`csrc/decoder_layer.c`) as ctypes structures: a
projection's weight (dense fp32, packed int8/int4, or a GGUF file's blocks), its LoRA stacks, a
step's adapter rows, and one layer's weights and settings, built from the model's layers
(`layer_struct`) by `workers.models.fused_layer`, which decides which layers take them."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from workers.kernels import gguf_gemm as gguf_kernels
from workers.quant.gguf_packed import GGUFMatmul, GGUFVnniMatmul
from workers.quant.linear import QuantizedMatmul

DENSE, INT8, INT4 = 0, 1, 2  # a projection's kind; then a GGUF file's blocks, by type
GGUF_KINDS = {name: 3 + kind for name, (kind, _) in gguf_kernels.TYPES.items()}
GGUF_VNNI = 6  # GGUF blocks laid out for the VNNI kernel (`group`: the type's id)


class Proj(ctypes.Structure):
    """`proj_t` of decoder_layer.c: one projection's weight, dense fp32 or packed int8/int4."""

    _fields_ = [("w", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p), ("group", ctypes.c_int64),
                ("kind", ctypes.c_int32), ("scales_bf16", ctypes.c_int32)]


MAX_SUBS = 4  # `lora_t`'s column_ends


class LoraProj(ctypes.Structure):
    """`lora_t`: one projection's LoRA stacks (`LoraProjection` a, bt, column_ends), a NULL:
    none."""

    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("width", ctypes.c_int64),
                ("num_subs", ctypes.c_int64), ("column_ends", ctypes.c_int64 * MAX_SUBS)]


class LoraStep(ctypes.Structure):
    """`lora_step_t`: a step's adapter rows grouped by slot and their segments (`LoraBatch`)."""

    _fields_ = [("rows", ctypes.c_void_p), ("segments", ctypes.c_void_p),
                ("num_segments", ctypes.c_int64), ("num_rows", ctypes.c_int64),
                ("scratch", ctypes.c_void_p)]  # the kernel's own


class Layer(ctypes.Structure):
    """`layer_t` of decoder_layer.c: one layer's weights and settings."""

    PROJECTIONS = ("qkv", "o", "gate_up", "down")
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)] + [
        (name, Proj) for name in PROJECTIONS] + [
        ("cos_sin", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in (
            "cos_sin_stride", "max_position", "hidden", "heads", "kv_heads", "head_dim",
            "inter")] + [
        (name, ctypes.c_float) for name in ("input_eps", "post_eps", "scale")] + [
        ("window", ctypes.c_int32), ("gelu", ctypes.c_int32)] + [
        (f"{name}_lora", LoraProj) for name in PROJECTIONS]


# The layers are Llama's, read by attribute (typed `Any`; `fused_layer.refusal` checks them).


def _proj(layer: Any) -> Proj:
    """The C struct of a projection `_fusable` takes."""
    matmul = layer.matmul
    if isinstance(matmul, GGUFMatmul):
        return Proj(layer.weight.data_ptr(), None, None, 0, GGUF_KINDS[matmul.ggml_type], 0)
    if isinstance(matmul, GGUFVnniMatmul):
        offsets = layer.offsets
        return Proj(layer.qweight.data_ptr(), layer.scales.data_ptr(),
                    None if offsets is None else offsets.data_ptr(),
                    gguf_kernels.TYPES[matmul.ggml_type][0], GGUF_VNNI, 0)
    if not isinstance(matmul, QuantizedMatmul):
        return Proj(layer.weight.data_ptr(), None, None, 0, DENSE, 0)
    if matmul.kernel == "int8":
        return Proj(layer.qweight.data_ptr(), layer.scales_f32.data_ptr(), None, 0, INT8, 0)
    offsets = layer.offsets
    return Proj(layer.qweight.data_ptr(), layer.scales.data_ptr(),
                None if offsets is None else offsets.data_ptr(), matmul.group_size, INT4,
                int(layer.scales.dtype == torch.bfloat16))


def _lora(layer: Any) -> LoraProj:
    """The C struct of a projection's LoRA stacks (workers.models.lora), zeros when it has none."""
    hook = getattr(layer, "lora", None)
    if hook is None:
        return LoraProj(None, None, 0, 0)
    ends = hook.column_ends if len(hook.column_ends) <= MAX_SUBS else (hook.out_features,)
    return LoraProj(hook.a.data_ptr(), hook.bt.data_ptr(), hook.a.shape[1], len(ends),
                    (ctypes.c_int64 * MAX_SUBS)(*ends))


def layer_struct(layer: Any) -> Layer:
    """The C struct of a decoder layer `refusal` passes."""
    attn, mlp = layer.self_attn, getattr(layer, layer.mlp_name)
    cache = attn.rotary_emb.cos_sin_cache
    return Layer(
        layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
        _proj(attn.qkv_proj), _proj(attn.o_proj), _proj(mlp.gate_up_proj),
        _proj(mlp.down_proj), cache.data_ptr(), cache.stride(0), cache.shape[0],
        layer.input_layernorm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
        mlp.down_proj.input_size // mlp.down_proj.tp_size,
        layer.input_layernorm.eps, layer.post_attention_layernorm.eps, attn.scale,
        attn.window or 0, int(mlp.gelu), _lora(attn.qkv_proj), _lora(attn.o_proj),
        _lora(mlp.gate_up_proj), _lora(mlp.down_proj))
