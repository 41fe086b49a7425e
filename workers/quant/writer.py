"""`cleave quantize`: a full-precision checkpoint rewritten in a quantized format of the hub.

Round-to-nearest (no calibration data): what matters here is the format, which GPTQ, AWQ,
llm-compressor and DeepSeek's FP8 tools all write the same way. Every 2-D `weight` of a decoder
layer is quantized except mixture-of-experts routers; embeddings and norms stay in full
precision, and so does `lm_head` unless `lm_head=True` (`cleave quantize --quantize-lm-head`):
GPTQ then stores it as it stores the layers (its config's `lm_head: true`), compressed-tensors
as int8 with one scale per output channel (a second config group naming `lm_head`: at about a
tenth of the weights, llama.cpp's Q4_0 files likewise keep `output.weight` at 6-8 bits). A model
whose output projection is its input embedding (`tie_word_embeddings`) is refused. Other files
(tokenizer, generation config) are copied; the output keeps the input's file layout.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.quant.formats import encode
from workers.quant.gptq import checkpoint_hessians, gptq_quantize
from workers.quant.scheme import QuantScheme, parse_quantization
from workers.quant.weights import quantize_fp8, quantize_int

FORMATS = ("gptq", "awq", "compressed-tensors", "compressed-tensors-fp8", "fp8")
_ROUTER = re.compile(r"\.(gate|shared_expert_gate)\.weight$")  # MoE routers stay as they are
_INDEX = "model.safetensors.index.json"


def quantization_config(fmt: str, bits: int = 4, group_size: int | None = 128,
                        symmetric: bool = True, act_order: bool = False,
                        block: int | None = 128, lm_head: bool = False) -> dict[str, Any]:
    """The `quantization_config` a checkpoint in `fmt` carries (as the format's tools write)."""
    group = group_size or -1
    if lm_head and fmt not in ("gptq", "compressed-tensors"):
        raise ValueError(f"a quantized lm_head is written in 'gptq' or 'compressed-tensors'; "
                         f"got format {fmt!r}")
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                "sym": symmetric, "checkpoint_format": "gptq", "lm_head": lm_head,
                "static_groups": False, "true_sequential": True, "damp_percent": 0.01}
    if fmt == "awq":
        if bits != 4:
            raise ValueError(f"awq stores 4-bit weights; got bits={bits}")
        return {"quant_method": "awq", "bits": 4, "group_size": group,
                "zero_point": not symmetric, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "fp8":
        config: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic"}
        if block:
            config["weight_block_size"] = [block, block]
        return config
    if fmt not in ("compressed-tensors", "compressed-tensors-fp8"):
        raise ValueError(f"unknown format {fmt!r}; expected one of {list(FORMATS)}")
    if fmt == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
                   "strategy": "group" if group_size else "channel", "group_size": group_size,
                   "dynamic": False, "actorder": None, "observer": "minmax"}
        layout = "pack-quantized"
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                   "group_size": None, "dynamic": False, "observer": "minmax"}
        layout = "float-quantized"
    groups = {"group_0": _ct_group(["Linear"], weights, layout)}
    if lm_head:
        groups["group_1"] = _ct_group(["lm_head"], {**weights, **_INT8_CHANNEL}, layout)
    ignore = [] if lm_head else ["lm_head"]
    return {"quant_method": "compressed-tensors", "format": layout,
            "quantization_status": "compressed",
            "ignore": [*ignore, "re:.*\\.(gate|shared_expert_gate)$"],
            "config_groups": groups, "kv_cache_scheme": None, "sparsity_config": {}}


_INT8_CHANNEL = {"num_bits": 8, "symmetric": True, "strategy": "channel", "group_size": None}


def _ct_group(targets: list[str], weights: dict[str, Any], layout: str) -> dict[str, Any]:
    return {"targets": targets, "weights": weights, "input_activations": None,
            "output_activations": None, "format": layout}


def quantize_checkpoint(src: str | Path, out: str | Path, fmt: str,
                        calibration: Sequence[str] | None = None, **options: Any) -> Path:
    """Writes `src` quantized in `fmt` to `out` (see `quantization_config` for the options).
    `calibration`: texts to run `src` on, and GPTQ instead of round-to-nearest
    (`workers.quant.gptq`; integer weights, scales per output channel or per group)."""
    src, out = Path(src), Path(out)
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config"):
        raise ValueError(f"{str(src)!r} is already quantized "
                         f"({raw['quantization_config'].get('quant_method')!r})")
    if options.get("lm_head") and raw.get("tie_word_embeddings"):
        raise ValueError(f"{str(src)!r} ties lm_head to its input embedding "
                         "(tie_word_embeddings=true): its lm_head stays in full precision; "
                         "expected an untied model to quantize lm_head")
    raw["quantization_config"] = quantization_config(fmt, **options)
    scheme = parse_quantization(raw)
    assert scheme is not None
    if calibration is not None:
        if scheme.kind != "int" or (scheme.act_order and scheme.group_size):
            raise ValueError(f"calibrated (GPTQ) weights are integers, with act-order only for "
                             f"one scale per output channel; got {scheme.describe()}: pass an "
                             f"integer format, and group_size None with act_order")
        options = {**options, "hessians": checkpoint_hessians(str(src), calibration)}
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {str(src)!r}")
    weight_map: dict[str, str] = {}
    for file in files:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 -- the handle is no mapping
                for out_name, tensor in _convert(scheme, name, f.get_tensor(name), options):
                    tensors[out_name] = tensor.contiguous()
                    weight_map[out_name] = file.name
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
    if scheme.lm_head and not any(name.startswith("lm_head.") for name in weight_map):
        raise ValueError(f"{str(src)!r} has no lm_head.weight to quantize; expected an untied "
                         "output projection")
    if (src / _INDEX).is_file():
        (out / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                             indent=2))
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                "config.json", _INDEX):
            shutil.copy2(extra, out / extra.name)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return out


def _convert(scheme: QuantScheme, name: str, tensor: torch.Tensor, options: dict[str, Any]):
    prefix, _, suffix = name.rpartition(".")
    quantize = (suffix == "weight" and tensor.dim() == 2 and scheme.quantizes(prefix)
                and (".layers." in name or prefix == "lm_head") and not _ROUTER.search(name))
    scheme = scheme.for_module(prefix)
    if not quantize:
        yield name, tensor
        return
    if scheme.kind == "fp8":
        if scheme.method == "fp8":
            w, scales = quantize_fp8(tensor, scheme.block)
        else:  # compressed-tensors: per channel, stored as [N, 1]
            w, scales = _per_channel_fp8(tensor)
        parts = encode(scheme, (w, scales))
    else:
        k = tensor.shape[1]
        if scheme.group_size and k % scheme.group_size:
            raise ValueError(f"{name}: input size {k} is not a multiple of group_size "
                             f"{scheme.group_size}; pass a group size that divides it")
        hessians = options.get("hessians")
        if hessians is not None:  # act-order (per channel) changes the pass, not the layout
            scale_dtype = torch.bfloat16 if scheme.layout.startswith("ct") else torch.float16
            weight = gptq_quantize(tensor, hessians[prefix], scheme.bits,
                                   act_order=scheme.act_order, scale_dtype=scale_dtype,
                                   group_size=scheme.group_size, symmetric=scheme.symmetric)
        else:
            g_idx = _act_order_groups(k, scheme.group_size or k) if scheme.act_order else None
            weight = quantize_int(tensor, scheme.bits, scheme.group_size, scheme.symmetric,
                                  g_idx)
        parts = encode(scheme, weight)
    for suffix_out, value in parts.items():
        yield f"{prefix}.{suffix_out}", value


def _per_channel_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales = (w.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (w.float() / scales).to(torch.float8_e4m3fn), scales


def _act_order_groups(k: int, group_size: int) -> torch.Tensor:
    """Act-order groups for `k` input columns: the same permutation for every module reading
    the same input (as GPTQ's, which orders columns by the shared activations' Hessian)."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(k))
    groups = torch.empty(k, dtype=torch.int64)
    groups[perm] = torch.arange(k) // group_size
    return groups
