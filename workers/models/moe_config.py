"""The sparse mixture-of-experts settings of a Hugging Face `config.json`, per family."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MoE block of Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss, in the HF config's
    terms."""

    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token goes to
    intermediate_size: int  # per routed expert
    norm_topk_prob: bool  # renormalize the top-k probabilities (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert, 0 for none
    decoder_sparse_step: int = 1  # every n-th layer is sparse (Qwen2-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense (Qwen2-MoE)
    # gpt-oss: top-k of the router's logits, then a softmax over those k (else: softmax, top-k);
    # a bias on the router and on every expert projection; and the clamped SwiGLU
    # (alpha, limit) instead of silu(gate) * up
    softmax_after_topk: bool = False
    bias: bool = False
    clamped_swiglu: tuple[float, float] | None = None
    # DeepSeek: experts chosen within the best `topk_group` of `n_group` groups when `groups`
    # is set, weighed by their scores times routed_scaling_factor, plus an ungated shared
    # expert. V3 ("sigmoid"): sigmoid scores plus a per-expert correction bias choose, a
    # group scores its two best experts, the chosen sigmoid scores are renormalized with
    # norm_topk_prob. V2 ("softmax"): softmax scores, a group scores its best expert.
    deepseek_scoring: str | None = None  # "sigmoid" (V3), "softmax" (V2), None: not DeepSeek
    groups: tuple[int, int] | None = None  # (n_group, topk_group)
    routed_scaling_factor: float = 1.0


def parse_moe(raw: Mapping[str, Any], model_type: str) -> MoEConfig | None:
    """The MoE block of `config.json`, None for a dense model."""
    if model_type == "mixtral":
        return MoEConfig(num_experts=int(raw["num_local_experts"]),
                         top_k=int(raw["num_experts_per_tok"]),
                         intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):  # Qwen3-MoE: no shared expert
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the hub's
        # configs (and Qwen2-MoE's) as num_experts
        return MoEConfig(
            num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()))
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return _deepseek(raw, model_type)
    if model_type == "gpt_oss":
        return MoEConfig(
            num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=False,
            softmax_after_topk=True, bias=True,
            clamped_swiglu=(float(raw.get("swiglu_alpha", 1.702)),
                            float(raw.get("swiglu_limit", 7.0))))
    return None


# DeepSeek's routing by version: (scoring_func, the topk_method values it may have)
_DEEPSEEK_ROUTING = {"deepseek_v3": ("sigmoid", ("noaux_tc",)),
                     "deepseek_v2": ("softmax", ("greedy", "group_limited_greedy"))}


def _deepseek(raw: Mapping[str, Any], model_type: str) -> MoEConfig:
    scoring, methods = _DEEPSEEK_ROUTING[model_type]
    if raw.get("scoring_func", scoring) != scoring:
        raise ValueError(f"scoring_func {raw['scoring_func']!r} is not supported for "
                         f"{model_type}; expected {scoring!r}")
    method = raw.get("topk_method") or methods[0]
    if method not in methods:
        raise ValueError(f"topk_method {method!r} is not supported for {model_type}; expected "
                         f"one of {list(methods)}")
    if int(raw.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"moe_layer_freq={raw['moe_layer_freq']} is not supported; "
                         "expected 1 (every layer after first_k_dense_replace is sparse)")
    inter = int(raw["moe_intermediate_size"])
    grouped = method in ("noaux_tc", "group_limited_greedy")
    return MoEConfig(
        num_experts=int(raw.get("n_routed_experts") or raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]), intermediate_size=inter,
        # V2's router never renormalizes (its configs say false); V3's does unless told not to
        norm_topk_prob=scoring == "sigmoid" and bool(raw.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=inter * int(raw.get("n_shared_experts") or 0),
        mlp_only_layers=tuple(range(int(raw.get("first_k_dense_replace") or 0))),
        deepseek_scoring=scoring,
        groups=(int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)) if grouped
        else None,
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0))
