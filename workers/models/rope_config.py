"""RoPE settings read from a Hugging Face `config.json`, in every spelling the hub has.

transformers < 5 writes `rope_theta` plus `rope_scaling` (keyed `type` or `rope_type`);
transformers 5 writes one `rope_parameters` dict (`rope_type`, `rope_theta`, scaling keys), or,
for models whose sliding-window layers use other RoPE settings than their global layers (Gemma
3), one such dict per layer type (`{"sliding_attention": {...}, "full_attention": {...}}`),
where older configs wrote the local base as `rope_local_base_freq`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

DEFAULT_ROPE_THETA = 10000.0
_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class RopeScaling:
    """Non-default RoPE frequency scaling, as transformers' `modeling_rope_utils` applies it."""

    rope_type: str  # "linear", "llama3", "yarn" or "freq_factors"
    factor: float
    # llama3 only
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None  # llama3 and yarn
    # yarn only: the ramp's bounds in rotations, whether they round to whole dimensions, and
    # the factor cos and sin are multiplied by (resolved from mscale/mscale_all_dim if unset)
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool = True
    attention_factor: float = 1.0
    mscale_all_dim: float | None = None  # DeepSeek scales its softmax by mscale(factor, this)**2
    # freq_factors only: a divisor per frequency (head_dim / 2), as GGUF files carry Llama 3's
    # scaling (llama.cpp's `rope_freqs` tensor)
    freq_factors: tuple[float, ...] | None = None

    def softmax_mscale(self) -> float:
        """The factor DeepSeek's attention multiplies its softmax scale by (1 when none)."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: RopeScaling | None  # None for the plain ("default") RoPE


def parse_rope(raw: Mapping[str, Any], default_theta: float = DEFAULT_ROPE_THETA) -> Rope:
    """The (global layers') RoPE: merges `rope_parameters` (transformers 5) and
    `rope_theta`/`rope_scaling` (older)."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or {})
    if "full_attention" in params:  # per layer type: the global layers' own
        params = dict(params["full_attention"] or {})
    params.update(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0
    if float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported; RoPE must cover "
                         "the whole head (1.0)")
    return Rope(float(theta), _scaling(params, raw))


def parse_local_rope(raw: Mapping[str, Any], default_theta: float) -> Rope:
    """Gemma 3's sliding-window layers' RoPE: plain, with their own base."""
    params = dict((raw.get("rope_parameters") or {}).get("sliding_attention") or {})
    theta = params.get("rope_theta", raw.get("rope_local_base_freq", default_theta))
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {params['rope_type']!r} on sliding_attention layers is not "
                         "supported; expected 'default'")
    return Rope(float(theta), None)


def _scaling(params: Mapping[str, Any], raw: Mapping[str, Any]) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        original = params.get(
            "original_max_position_embeddings", raw.get("max_position_embeddings", 2048)
        )
        return RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    if rope_type == "yarn":
        return _yarn(params, raw)
    raise ValueError(f"unsupported rope type {rope_type!r}; expected one of "
                     "['default', 'linear', 'llama3', 'yarn']")


def _yarn(params: Mapping[str, Any], raw: Mapping[str, Any]) -> RopeScaling:
    """YaRN as transformers' `_compute_yarn_parameters` reads it (gpt-oss, DeepSeek-V3)."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:
        factor = int(raw["max_position_embeddings"]) / original
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=float(params.get("beta_fast") or 32),
                       beta_slow=float(params.get("beta_slow") or 1),
                       truncate=bool(params.get("truncate", True)),
                       attention_factor=float(attention_factor),
                       mscale_all_dim=(None if params.get("mscale_all_dim") is None
                                       else float(params["mscale_all_dim"])))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def layer_types(raw: Mapping[str, Any], num_layers: int, pattern: int) -> tuple[str, ...]:
    """Each layer's attention kind, "sliding_attention" or "full_attention": `layer_types` as
    written, or (older configs) every `sliding_window_pattern`-th layer global (`pattern` when
    unwritten: Gemma 3's 6, gpt-oss's 2)."""
    written = raw.get("layer_types")
    if written is None:
        pattern = int(raw.get("sliding_window_pattern") or pattern)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(num_layers))
    kinds = tuple(str(kind) for kind in written)
    bad = sorted(set(kinds) - set(_LAYER_TYPES))
    if bad or len(kinds) != num_layers:
        raise ValueError(f"layer_types must list one of {list(_LAYER_TYPES)} for each of the "
                         f"{num_layers} layers, got {list(kinds)}")
    return kinds
