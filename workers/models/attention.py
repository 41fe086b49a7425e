"""The Llama family's attention block: fused q/k/v projection, RoPE, the attention backend, the
output projection, sharded by heads over the tensor-parallel group.

The families differ only here: q/k/v bias (Qwen2), o_proj bias (Llama's and Qwen3's
`attention_bias`), Qwen3's and Gemma 3's RMSNorm of each head's q and k before RoPE (its
weights, one per head dimension, are the same on every TP rank), and per-layer settings: a
sliding window (Mistral on every layer, Gemma 3 on its local layers), the local layers' own RoPE
base and the attention scale (Gemma 3), attention sinks (gpt-oss: one logit per query head,
split over TP ranks with the heads).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.models.model_config import ModelConfig
from workers.models.layers import (
    QKVParallelLinear,
    RowParallelLinear,
    Shard,
    _check_shape,
    _make_param,
    _sharded_copy,
)
from workers.models.rotary import RotaryEmbedding
from workers.models.norm import RMSNorm


class LlamaAttention(nn.Module):
    """`norm_cls`: the q/k norm's class, where the model has one (Gemma's adds one to its
    weights)."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, attn_backend: AttentionBackend, shard: Shard,
        norm_cls: type[RMSNorm] = RMSNorm,
    ) -> None:
        tp_rank, tp_size = shard.tp_rank, shard.tp_size
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_backend = attn_backend
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=config.attention_bias,
            tp_rank=tp_rank, tp_size=tp_size,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size,
            bias=config.o_proj_bias, tp_rank=tp_rank, tp_size=tp_size, comm=shard.comm,
            site="attn",
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, *config.rope_of(layer_idx))
        self.scale = config.attention_scale
        self.window = config.window_of(layer_idx)
        if config.qk_norm:  # per head, over head_dim: the same weights on every TP rank
            self.q_norm = norm_cls(config.head_dim, config.rms_norm_eps)
            self.k_norm = norm_cls(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.sinks = None
        if config.attention_sinks:
            self.sinks = _make_param((self.num_heads,), self._load_sinks)
        self.tp_rank, self.total_heads = tp_rank, config.num_attention_heads
        # a backend with `forward_rotary` (triton) rotates q and k itself, fused with its KV
        # write; the others take rotated q and k
        self.rope_in_backend = getattr(attn_backend, "rotates_qk", False)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: object = None) -> None:
        _check_shape(loaded, (self.total_heads,), "attention sinks")
        _sharded_copy(param, loaded, 0, self.tp_rank * self.num_heads, self.num_heads)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        num_tokens, q_size, qk_size = x.shape[0], self.q_size, self.q_size + self.kv_size
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size:qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_in_backend:  # one kernel rotates q and k and stores k and v
            # a backend that sets `rotates_qk` has `forward_rotary`, which the base class lacks
            out = self.attn_backend.forward_rotary(  # type: ignore[attr-defined]  # rotates_qk
                positions, self.rotary_emb.cos_sin_cache, q, k, v, kv_cache, meta,
                scale=self.scale, window=self.window, sinks=self.sinks)
        else:
            if self.qk_norm:
                q, k = self.rotary_emb(positions, q, k)
            else:  # q and k side by side: rotated together
                qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)
                q, k = self.rotary_emb.rotate_qk(positions, qk, self.num_heads)
            out = self.attn_backend.forward(q, k, v, kv_cache, meta, scale=self.scale,
                                            window=self.window, sinks=self.sinks)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, q_size))
