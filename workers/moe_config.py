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
    if model_type == "gpt_oss":
        return MoEConfig(
            num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=False,
            softmax_after_topk=True, bias=True,
            clamped_swiglu=(float(raw.get("swiglu_alpha", 1.702)),
                            float(raw.get("swiglu_limit", 7.0))))
    return None
