"""Mixtral: the Mistral decoder with a sparse MoE block ("block_sparse_moe") in every layer."""

from __future__ import annotations

import re

from torch import nn

from workers.models.llama import LlamaForCausalLM
from workers.models.moe import DOWN, GATE, UP, SparseMoeBlock

# model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight -> (..experts.w13_weight, (j, GATE));
# .bias -> w13_bias (gpt-oss's, once unstacked)
_EXPERT = re.compile(
    r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|bias)$")
_PART = {"w1": GATE, "gate_proj": GATE, "w3": UP, "up_proj": UP, "w2": DOWN, "down_proj": DOWN}


def expert_name(hf_name: str) -> tuple[str, object] | None:
    """(our fused expert parameter, (expert, part)) for an HF per-expert tensor, else None."""
    match = _EXPERT.match(hf_name)
    if match is None:
        return None
    prefix, expert, part = match.group(1), int(match.group(2)), _PART[match.group(3)]
    param = f"{'w2' if part == DOWN else 'w13'}_{match.group(4)}"
    return f"{prefix}.{param}", (expert, part)


class MixtralForCausalLM(LlamaForCausalLM):
    """Routing: softmax in fp32, top-k, renormalized, weights kept in fp32 (as transformers)."""

    # expert dispatch reads per-expert token counts on the host: not capturable
    cuda_graph_safe = False

    def make_mlp(self, layer_idx: int) -> tuple[str, nn.Module]:
        moe = self.config.moe
        if moe is None:
            raise ValueError("a Mixtral config needs num_local_experts and num_experts_per_tok")
        return "block_sparse_moe", SparseMoeBlock(
            self.config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
            normalize=True, shard=self.shard, comm=self.shard.comm)

    def map_name(self, hf_name: str) -> tuple[str, object]:
        return expert_name(hf_name) or super().map_name(hf_name)

    def num_shards(self, name: str) -> int:
        num_experts = self.config.moe.num_experts  # type: ignore[union-attr]  # an MoE family
        if name.endswith((".w13_weight", ".w13_bias")):
            return 2 * num_experts
        if name.endswith((".w2_weight", ".w2_bias")):
            return num_experts
        return super().num_shards(name)
