"""What a checkpoint's `quantization_config` says, read into one `QuantScheme`.

The formats users download from the hub, by `quant_method`:
- `gptq`: int4/int8 weights packed into int32 along the input dimension, per-group scales and
  packed zero points (`checkpoint_format` "gptq" stores zero - 1, "gptq_v2" the zero itself),
  optional act-order (`desc_act`, with a `g_idx` per input column); `lm_head: true` stores the
  output projection the same way.
- `awq`: int4 GEMM packing along the output dimension in AWQ's interleaved order, zero points.
- `compressed-tensors`: `pack-quantized` (int4/int8 packed into int32, per-group or per-channel
  scales, optional zero points), `int-quantized` (int8 tensors, per-channel scales) and
  `float-quantized` (FP8 e4m3 weights, per-tensor, per-channel or 128x128 block scales); one
  config group for the linear layers and optionally a second whose targets name `lm_head` (as
  llm-compressor writes a different scheme for the output projection, e.g. int8 per channel
  beside int4 groups, as llama.cpp keeps `output.weight` at higher precision).
- `fp8`: FP8 e4m3 weights with `weight_scale_inv` per 128x128 block (DeepSeek-V3,
  transformers' FineGrainedFP8) or a per-tensor `weight_scale` (no `weight_block_size`).

Activations always run unquantized here (weight-only): a W8A8 checkpoint's activation scheme is
read and ignored. Anything else is refused with the variant named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Mapping

METHODS = ("gptq", "awq", "compressed-tensors", "fp8")


@dataclass(frozen=True)
class QuantScheme:
    """How one checkpoint's linear weights are stored.

    `kind`: "int" (integer weights, scale per group, zero points when not `symmetric`) or "fp8".
    `layout`: the tensors' on-disk layout: "gptq", "awq", "ct-packed", "ct-int", "fp8".
    `group_size`: input columns per scale (int formats); None: one scale per output channel.
    `block`: FP8 scale blocks (output rows, input columns); None for per-tensor/per-channel.
    `skip`: module-name patterns left in full precision (the config's ignore list).
    `lm_head`: how the output projection is stored when the checkpoint quantizes it (GPTQ's
    `lm_head: true`: this same scheme; compressed-tensors: the group that names it); None: in
    full precision. Input embeddings are never quantized.
    """

    method: str
    kind: str
    layout: str
    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    act_order: bool = False
    zero_offset: int = 0  # GPTQ v1 stores each zero point minus one
    block: tuple[int, int] | None = None
    fp8_scale_name: str = "weight_scale"
    skip: tuple[str, ...] = field(default_factory=tuple)
    lm_head: QuantScheme | None = None

    def for_module(self, module: str) -> QuantScheme:
        """The scheme the module `module` (a checkpoint prefix) is stored in, if quantized."""
        return self.lm_head if module.endswith("lm_head") and self.lm_head else self

    def quantizes(self, module: str) -> bool:
        """Whether the linear module `module` (a checkpoint prefix) is stored quantized."""
        if "embed_tokens" in module:
            return False
        for pattern in self.skip:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern):
                return False
        return self.lm_head is not None if module.endswith("lm_head") else True

    def describe(self) -> str:
        if self.kind == "fp8":
            scale = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "per-tensor"
            return f"{self.method} fp8 e4m3 ({scale})"
        group = f"group {self.group_size}" if self.group_size else "per-channel"
        zero = "symmetric" if self.symmetric else "zero points"
        order = ", act-order" if self.act_order else ""
        head = "" if self.lm_head is None else ", lm_head too" if self.lm_head == replace(
            self, lm_head=None) else f"; lm_head {self.lm_head.describe().partition(' ')[2]}"
        return f"{self.method} int{self.bits} ({group}, {zero}{order}{head})"


def parse_quantization(raw: Mapping[str, Any]) -> QuantScheme | None:
    """The checkpoint's scheme from its config.json, None when it is full precision.

    Raises ValueError naming the unsupported method or variant and what is supported.
    """
    config = raw.get("quantization_config") or raw.get("compression_config")
    if not config:
        return None
    if not isinstance(config, Mapping):
        raise ValueError(f"quantization_config must be an object, got {config!r}")
    method = config.get("quant_method")
    if method == "gptq":
        return _gptq(config)
    if method == "awq":
        return _awq(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fp8":
        return _fp8(config)
    raise ValueError(f"quantization_config quant_method {method!r} is not supported; expected "
                     f"one of {list(METHODS)}")


def _bits(config: Mapping[str, Any], allowed: tuple[int, ...], what: str) -> int:
    bits = config.get("bits", config.get("w_bit", config.get("num_bits")))
    if bits not in allowed:
        raise ValueError(f"{what} with {bits!r}-bit weights is not supported; expected "
                         f"{' or '.join(map(str, allowed))} bits")
    return int(bits)


def _group(value: Any, what: str) -> int | None:
    if value in (None, -1, 0):
        return None
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} group_size {value!r} is not supported; expected a positive "
                         "integer or -1 (per channel)")
    return value


def _gptq(config: Mapping[str, Any]) -> QuantScheme:
    bits = _bits(config, (4, 8), "gptq")
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported; expected 'gptq' or "
                         "'gptq_v2'")
    lm_head = config.get("lm_head", False)
    if not isinstance(lm_head, bool):
        raise ValueError(f"gptq lm_head {lm_head!r} is not supported; expected true or false")
    skip = tuple(config.get("modules_to_not_convert") or ())
    scheme = QuantScheme(
        "gptq", "int", "gptq", bits=bits, group_size=_group(config.get("group_size"), "gptq"),
        symmetric=bool(config.get("sym", True)), act_order=bool(config.get("desc_act", False)),
        zero_offset=1 if fmt == "gptq" else 0, skip=skip,
    )
    return replace(scheme, lm_head=scheme) if lm_head else scheme


def _awq(config: Mapping[str, Any]) -> QuantScheme:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq version {version!r} is not supported; expected 'gemm'")
    bits = _bits(config, (4,), "awq")
    return QuantScheme(
        "awq", "int", "awq", bits=bits,
        group_size=_group(config.get("group_size", config.get("q_group_size")), "awq"),
        symmetric=not config.get("zero_point", True),
        skip=tuple(config.get("modules_to_not_convert") or ()),
    )


def _fp8(config: Mapping[str, Any]) -> QuantScheme:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 fmt {fmt!r} is not supported; expected 'e4m3'")
    block = config.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"fp8 weight_block_size {block!r} is not supported; expected two "
                             "positive integers such as [128, 128]")
        block = (int(block[0]), int(block[1]))
    return QuantScheme(
        "fp8", "fp8", "fp8", bits=8, block=block,
        fp8_scale_name="weight_scale_inv" if block else "weight_scale",
        skip=tuple(config.get("modules_to_not_convert") or ()),
    )


def _compressed_tensors(config: Mapping[str, Any]) -> QuantScheme:
    groups = list((config.get("config_groups") or {}).values())
    skip = tuple(config.get("ignore") or ())
    heads = [g for g in groups if _targets_lm_head(g)]
    bodies = [g for g in groups if not _targets_lm_head(g)]
    if len(bodies) != 1 or len(heads) > 1:
        raise ValueError(f"compressed-tensors with config_groups targeting "
                         f"{[g.get('targets') for g in groups]} is not supported; expected one "
                         "group for the linear layers and at most one more naming lm_head")
    scheme = _ct_group(bodies[0], config.get("format"), skip)
    if heads:  # (unless `ignore` lists lm_head too: `quantizes` reads the ignore list first)
        scheme = replace(scheme, lm_head=_ct_group(heads[0], config.get("format"), ()))
    return scheme


def _targets_lm_head(group: Mapping[str, Any]) -> bool:
    """Whether a compressed-tensors config group is for the output projection alone."""
    targets = group.get("targets") or []
    return bool(targets) and all(
        t == "lm_head" or (t.startswith("re:") and re.fullmatch(t[3:], "lm_head"))
        for t in targets)


def _ct_group(group: Mapping[str, Any], default_format: Any, skip: tuple[str, ...]
              ) -> QuantScheme:
    weights = group.get("weights") or {}
    fmt = group.get("format") or default_format
    strategy = weights.get("strategy")
    kind = weights.get("type", "int")
    bits = weights.get("num_bits")
    if kind == "float":
        if bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors float weights with num_bits={bits!r}, format "
                             f"{fmt!r} are not supported; expected 8 bits, 'float-quantized'")
        if strategy == "block":
            block = tuple(weights.get("block_structure") or ())
            if len(block) != 2:
                raise ValueError(f"compressed-tensors block_structure {block!r} is not "
                                 "supported; expected two integers")
            return QuantScheme("compressed-tensors", "fp8", "fp8", block=(block[0], block[1]),
                               skip=skip)
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors fp8 strategy {strategy!r} is not supported; "
                             "expected 'tensor', 'channel' or 'block'")
        return QuantScheme("compressed-tensors", "fp8", "fp8", skip=skip)
    if kind != "int":
        raise ValueError(f"compressed-tensors weight type {kind!r} is not supported; expected "
                         "'int' or 'float'")
    if fmt not in ("pack-quantized", "int-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; expected "
                         "'pack-quantized', 'int-quantized' or 'float-quantized'")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors int strategy {strategy!r} is not supported; "
                         "expected 'group' or 'channel'")
    if weights.get("actorder") not in (None, False, "static"):
        raise ValueError(f"compressed-tensors actorder {weights.get('actorder')!r} is not "
                         "supported; expected null or 'static'")
    return QuantScheme(
        "compressed-tensors", "int", "ct-packed" if fmt == "pack-quantized" else "ct-int",
        bits=_bits(weights, (4, 8), "compressed-tensors"),
        group_size=weights.get("group_size") if strategy == "group" else None,
        symmetric=bool(weights.get("symmetric", True)), skip=skip,
    )
