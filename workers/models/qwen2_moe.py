"""Qwen2-MoE: the Qwen2 decoder whose MLPs are sparse MoE blocks with a gated shared expert
(dense layers where `mlp_only_layers` / `decoder_sparse_step` say so)."""

from __future__ import annotations

from torch import nn

from workers.models.llama import LlamaMLP
from workers.models.mixtral import MixtralForCausalLM
from workers.models.moe import SparseMoeBlock


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    """Routing: softmax in fp32, top-k, renormalized only with `norm_topk_prob`, weights cast
    to the activations' dtype; plus sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

    def make_mlp(self, layer_idx: int) -> tuple[str, nn.Module]:
        moe = self.config.moe
        if moe is None:
            raise ValueError("a Qwen2-MoE config needs num_experts and num_experts_per_tok")
        if not self.config.is_moe_layer(layer_idx):
            return "mlp", LlamaMLP(self.config, self.shard)
        shared = None
        if moe.shared_expert_intermediate_size:
            shared = LlamaMLP(self.config, self.shard, moe.shared_expert_intermediate_size,
                              site="shared_expert")
        return "mlp", SparseMoeBlock(
            self.config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
            normalize=moe.norm_topk_prob, shard=self.shard, comm=self.shard.comm,
            shared_expert=shared, cast_weights=True)
