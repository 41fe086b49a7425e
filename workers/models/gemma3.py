"""Gemma 3 (text): the Llama decoder with Gemma's own pieces, following transformers'
`modeling_gemma3`:

- RMSNorm scales by `1 + weight` (the checkpoints store the offset from one), computed in fp32
  and cast back after the product;
- four norms per layer: around attention (input, post-attention) and around the MLP
  (pre- and post-feedforward), the post norms applied to each sublayer's output before its
  residual add;
- the embedding multiplied by sqrt(hidden_size), rounded to the weights' dtype;
- q/k norm, a gelu(tanh) MLP, attention scaled by `query_pre_attn_scalar ** -0.5`, and sliding
  windows with their own RoPE base on the local layers (`ModelConfig.layer_types`), which
  `LlamaAttention` and `LlamaMLP` read from the config.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.models.model_config import ModelConfig
from workers.models.attention import LlamaAttention
from workers.models.layers import Shard
from workers.models.norm import RMSNorm
from workers.models.llama import LlamaForCausalLM, LlamaModel


class GemmaRMSNorm(RMSNorm):
    gemma = True

    def torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, attn_backend: AttentionBackend, shard: Shard,
        mlp_name: str, mlp: nn.Module,
    ) -> None:
        super().__init__()
        if mlp_name != "mlp":
            raise ValueError(f"Gemma 3 layers have a dense 'mlp', got {mlp_name!r}")
        self.self_attn = LlamaAttention(config, layer_idx, attn_backend, shard,
                                        norm_cls=GemmaRMSNorm)
        self.mlp = mlp
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor,
        residual: torch.Tensor | None, kv_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # as LlamaDecoderLayer: (this layer's output, the residual it is to be added to);
        # each sublayer's output is normed before its residual add
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attn = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.pre_feedforward_layernorm(
            self.post_attention_layernorm(attn), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    def make_model(self, config: ModelConfig, attn_backend: AttentionBackend) -> LlamaModel:
        return LlamaModel(config, attn_backend, self.shard, self.make_mlp,
                          layer_cls=Gemma3DecoderLayer, norm_cls=GemmaRMSNorm,
                          embed_scale=config.hidden_size ** 0.5)
