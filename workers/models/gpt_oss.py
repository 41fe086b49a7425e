"""gpt-oss (bf16 or fp32 weights): the Llama decoder with biased q/k/v/o projections, attention
sinks, sliding-window attention on every other layer (`ModelConfig.layer_types`), YaRN RoPE,
and in every layer a sparse MoE block whose router has a bias and takes the top k logits before
its softmax, and whose experts have biases and gpt-oss's clamped SwiGLU.

Its checkpoints store each layer's experts stacked: `mlp.experts.gate_up_proj` [E, H, 2I] with
gate and up interleaved along the last axis (gate the even columns), `down_proj` [E, I, H] (both
transposed against nn.Linear), their biases [E, 2I] and [E, H], and the router as `mlp.router`.
They are unstacked into the per-expert tensors the MoE loader shards (by TP or EP) as it does
Mixtral's. The MXFP4 checkpoints OpenAI publishes (`quantization_config`) are refused by
`ModelConfig` until quantized weights are supported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from workers.models.mixtral import MixtralForCausalLM
from workers.models.moe import SparseMoeBlock

_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


class GptOssForCausalLM(MixtralForCausalLM):
    def make_mlp(self, layer_idx: int) -> tuple[str, nn.Module]:
        moe = self.config.moe
        if moe is None:
            raise ValueError("a gpt-oss config needs num_local_experts and num_experts_per_tok")
        return "mlp", SparseMoeBlock(
            self.config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
            normalize=False, shard=self.shard, comm=self.shard.comm, moe=moe)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._unstack(weights))

    def _unstack(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF's stacked expert tensors as per-expert `experts.{e}.{gate,up,down}_proj.{weight,
        bias}` in nn.Linear's layout; the router under the MoE block's name (`gate`)."""
        for name, tensor in weights:
            match = _STACKED.match(name)
            if match is None:
                yield name.replace(".mlp.router.", ".mlp.gate."), tensor
                continue
            prefix, proj, bias = match.group(1), match.group(2), match.group(3) is not None
            suffix = "bias" if bias else "weight"
            for e in range(tensor.shape[0]):
                expert = tensor[e]
                if proj == "down_proj":  # [I, H] -> [H, I]; its bias [H]
                    yield f"{prefix}.{e}.down_proj.{suffix}", expert if bias else expert.t()
                    continue
                gate, up = expert[..., 0::2], expert[..., 1::2]  # [H, I] each (bias: [I])
                yield f"{prefix}.{e}.gate_proj.{suffix}", gate if bias else gate.t()
                yield f"{prefix}.{e}.up_proj.{suffix}", up if bias else up.t()
