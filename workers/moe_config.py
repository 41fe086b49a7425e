"""The sparse mixture-of-experts settings of a Hugging Face `config.json`, per family."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MoE block of Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss, in the HF config's terms."""

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
    # DeepSeek-V3: sigmoid scores plus a per-expert correction bias choose the experts, first
    # the best `topk_group` of `n_group` groups (each scored by its two best experts); the
    # chosen sigmoid scores (renormalized with norm_topk_prob) times routed_scaling_factor
    # weigh them; and a shared expert (not gated) is added
    sigmoid_groups: tuple[int, int] | None = None  # (n_group, topk_group)
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
            num_experts=int(raw.get("num_experts") or raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()))
    if model_type == "deepseek_v3":
        for key, v3 in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if raw.get(key, v3) != v3:
                raise ValueError(f"{key} {raw[key]!r} is not supported; expected {v3!r} "
                                 "(DeepSeek-V3's routing)")
        if int(raw.get("moe_layer_freq") or 1) != 1:
            raise ValueError(f"moe_layer_freq={raw['moe_layer_freq']} is not supported; "
                             "expected 1 (every layer after first_k_dense_replace is sparse)")
        inter = int(raw["moe_intermediate_size"])
        return MoEConfig(
            num_experts=int(raw.get("n_routed_experts") or raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]), intermediate_size=inter,
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            shared_expert_intermediate_size=inter * int(raw.get("n_shared_experts") or 0),
            mlp_only_layers=tuple(range(int(raw.get("first_k_dense_replace") or 0))),
            sigmoid_groups=(int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0))
    if model_type == "gpt_oss":
        return MoEConfig(
            num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=False,
            softmax_after_topk=True, bias=True,
            clamped_swiglu=(float(raw.get("swiglu_alpha", 1.702)),
                            float(raw.get("swiglu_limit", 7.0))))
    return None
