"""The on-disk tensors of each format, read into `IntWeight`/`Fp8Weight` and written from them.

One linear module's tensors share its prefix (`model.layers.0.self_attn.q_proj`); `parts` maps
each suffix (`qweight`, `scales`, ...) to its tensor. `required_parts` says which suffixes one
module needs, so the loader knows when a module is complete.
"""

from __future__ import annotations

import torch

from workers.quant.packing import AWQ_ORDER, pack_int32, unpack_int32
from workers.quant.scheme import QuantScheme
from workers.quant.weights import FP8, Fp8Weight, IntWeight, expand_fp8_scales


def required_parts(scheme: QuantScheme) -> tuple[str, ...]:
    """The tensor suffixes that make up one quantized module in `scheme`'s layout."""
    if scheme.layout == "gptq":
        return ("qweight", "qzeros", "scales") + (("g_idx",) if scheme.act_order else ())
    if scheme.layout == "awq":
        return ("qweight", "qzeros", "scales")
    zero = () if scheme.symmetric else ("weight_zero_point",)
    if scheme.layout == "ct-packed":
        return ("weight_packed", "weight_scale", "weight_shape") + zero
    if scheme.layout == "ct-int":
        return ("weight", "weight_scale") + zero
    return ("weight", scheme.fp8_scale_name)


# suffixes a quantized module may carry that weight-only serving does not use
IGNORED_PARTS = ("g_idx", "input_scale", "weight_g_idx", "bias_scale", "k_scale", "v_scale")


def decode(scheme: QuantScheme, parts: dict[str, torch.Tensor]) -> IntWeight | Fp8Weight:
    """One module's tensors -> its weight in Cleave's form. Raises ValueError on bad shapes."""
    if scheme.layout == "gptq":
        return _decode_gptq(scheme, parts)
    if scheme.layout == "awq":
        return _decode_awq(scheme, parts)
    if scheme.layout == "ct-packed":
        return _decode_ct_packed(scheme, parts)
    if scheme.layout == "ct-int":
        scales = parts["weight_scale"].float()
        q = parts["weight"].to(torch.int8)
        zeros = parts.get("weight_zero_point")
        zeros = torch.zeros_like(scales) if zeros is None else zeros.float().reshape(scales.shape)
        return IntWeight(q, scales.reshape(q.shape[0], -1), zeros.reshape(q.shape[0], -1),
                         scheme.bits)
    w = parts["weight"]
    if w.dtype != FP8:
        raise ValueError(f"fp8 weight of dtype {w.dtype}; expected {FP8}")
    n, k = w.shape
    return Fp8Weight(w, expand_fp8_scales(parts[scheme.fp8_scale_name], n, k, scheme.block))


def _signed(values: torch.Tensor, bits: int) -> torch.Tensor:
    return values - (1 << (bits - 1))


def _decode_gptq(scheme: QuantScheme, parts: dict[str, torch.Tensor]) -> IntWeight:
    b = scheme.bits
    q = unpack_int32(parts["qweight"].t(), b)  # packed along K: [N, K]
    scales = parts["scales"].float().t().contiguous()  # [N, G]
    zeros = unpack_int32(parts["qzeros"], b)[:, : scales.shape[0]] + scheme.zero_offset
    g_idx = parts["g_idx"].long() if scheme.act_order else None
    return IntWeight(_signed(q, b).to(torch.int8).contiguous(), scales,
                     _signed(zeros, b).float().t().contiguous(), b, g_idx)


def _decode_awq(scheme: QuantScheme, parts: dict[str, torch.Tensor]) -> IntWeight:
    q = unpack_int32(parts["qweight"], 4, AWQ_ORDER)  # [K, N]
    zeros = unpack_int32(parts["qzeros"], 4, AWQ_ORDER)  # [G, N]
    return IntWeight(_signed(q, 4).t().to(torch.int8).contiguous(),
                     parts["scales"].float().t().contiguous(),
                     _signed(zeros, 4).t().float().contiguous(), 4)


def _decode_ct_packed(scheme: QuantScheme, parts: dict[str, torch.Tensor]) -> IntWeight:
    b = scheme.bits
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    q = _signed(unpack_int32(parts["weight_packed"], b)[:, :k], b)
    scales = parts["weight_scale"].float().reshape(n, -1)
    zero = parts.get("weight_zero_point")
    if zero is None:
        zeros = torch.zeros_like(scales)
    else:  # signed zero points packed along the output dimension
        zeros = _signed(unpack_int32(zero.t(), b), b).t()[:n].float()
    return IntWeight(q.to(torch.int8).contiguous(), scales.contiguous(),
                     zeros.contiguous(), b)


def encode(scheme: QuantScheme, weight: IntWeight | Fp8Weight | tuple[torch.Tensor, torch.Tensor]
           ) -> dict[str, torch.Tensor]:
    """A weight -> the tensors `scheme`'s layout stores for it (what `cleave quantize` writes).
    FP8 weights come as (w_fp8, checkpoint-shaped scales) from `quantize_fp8`."""
    if scheme.kind == "fp8":
        w, scales = weight  # type: ignore[misc]  # fp8 schemes get (w_fp8, scales)
        return {"weight": w, scheme.fp8_scale_name: scales.float()}
    assert isinstance(weight, IntWeight)
    b, offset = weight.bits, 1 << (weight.bits - 1)
    q_u = weight.q.to(torch.int64) + offset  # [N, K] unsigned
    z_u = weight.zeros.to(torch.int64) + offset  # [N, G]
    half = torch.float16
    if scheme.layout == "gptq":
        if scheme.zero_offset and not scheme.symmetric and bool((z_u == 0).any()):
            raise ValueError("gptq (v1) cannot store a zero point of 0; use symmetric weights")
        return {"qweight": pack_int32(q_u, b).t().contiguous(),  # packed along K: [K/w, N]
                "qzeros": pack_int32((z_u - scheme.zero_offset).t().contiguous() % (1 << b), b),
                "scales": weight.scales.t().to(half).contiguous(),
                "g_idx": weight.groups().to(torch.int32)}
    if scheme.layout == "awq":
        return {"qweight": pack_int32(q_u.t().contiguous(), 4, AWQ_ORDER),
                "qzeros": pack_int32(z_u.t().contiguous(), 4, AWQ_ORDER),
                "scales": weight.scales.t().to(half).contiguous()}
    parts = {"weight_scale": weight.scales.to(torch.bfloat16)}
    if scheme.layout == "ct-packed":
        parts["weight_packed"] = pack_int32(q_u, b)
        parts["weight_shape"] = torch.tensor(list(weight.q.shape), dtype=torch.int64)
        if not scheme.symmetric:
            parts["weight_zero_point"] = pack_int32(z_u.t().contiguous(), b).t().contiguous()
    else:
        parts["weight"] = weight.q
        if not scheme.symmetric:
            parts["weight_zero_point"] = weight.zeros.to(torch.int8)
    return parts
