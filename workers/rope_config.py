"""RoPE settings read from a Hugging Face `config.json`, in every spelling the hub has.

transformers < 5 writes `rope_theta` plus `rope_scaling` (keyed `type` or `rope_type`);
transformers 5 writes one `rope_parameters` dict (`rope_type`, `rope_theta`, scaling keys), or,
for models whose sliding-window layers use other RoPE settings than their global layers (Gemma
3), one such dict per layer type (`{"sliding_attention": {...}, "full_attention": {...}}`),
where older configs wrote the local base as `rope_local_base_freq`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

DEFAULT_ROPE_THETA = 10000.0
_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class RopeScaling:
    """Non-default RoPE frequency scaling, as transformers' `modeling_rope_utils` applies it."""

    rope_type: str  # "linear" or "llama3"
    factor: float
    # llama3 only
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


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
    raise ValueError(
        f"unsupported rope type {rope_type!r}; expected one of ['default', 'linear', 'llama3']"
    )


def layer_types(raw: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind, "sliding_attention" or "full_attention": `layer_types` as
    written, or (older Gemma 3 configs) every `sliding_window_pattern`-th layer global."""
    written = raw.get("layer_types")
    if written is None:
        pattern = int(raw.get("sliding_window_pattern") or 6)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(num_layers))
    kinds = tuple(str(kind) for kind in written)
    bad = sorted(set(kinds) - set(_LAYER_TYPES))
    if bad or len(kinds) != num_layers:
        raise ValueError(f"layer_types must list one of {list(_LAYER_TYPES)} for each of the "
                         f"{num_layers} layers, got {list(kinds)}")
    return kinds
