"""Phi-3: the Llama decoder, with its checkpoints' q/k/v and gate/up projections each stored as
one fused tensor (`qkv_proj`, `gate_up_proj`). They are split into the parts the Llama loader
knows before loading, so tensor parallelism shards each part as it does for Llama."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from workers.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split(weights))

    def _split(self, weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                for part, piece in zip(("q_proj", "k_proj", "v_proj"),
                                       tensor.split([q, kv, kv], dim=0)):
                    yield name.replace(".qkv_proj.", f".{part}."), piece
            elif ".mlp.gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor
