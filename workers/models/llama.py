"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat batch of tokens.

The architectures differ only in q/k/v bias (Qwen2), o_proj bias (Llama's `attention_bias`) and
tied input/output embeddings; the arithmetic, including the order of residual adds and the fp32
RMSNorm, follows transformers' `modeling_llama` so fp32 logits match it to ~1e-5.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention.backend import AttentionBackend, AttentionMetadata
from workers.model_config import ModelConfig
from workers.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightShapeError,
    kv_heads_per_rank,
)

# (our fused parameter, the HF projection it is made of, shard id)
_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
_SHARDS_PER_PARAM = {"qkv_proj": 3, "gate_up_proj": 2}


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, attn_backend: AttentionBackend,
        tp_rank: int, tp_size: int,
    ) -> None:
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
            bias=config.o_proj_bias, tp_rank=tp_rank, tp_size=tp_size,
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling,
        )
        self.scale = config.head_dim**-0.5

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn_backend.forward(q, k, v, kv_cache, meta, scale=self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=config.mlp_bias,
            tp_rank=tp_rank, tp_size=tp_size,
        )
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias=config.mlp_bias, tp_rank=tp_rank, tp_size=tp_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each [T, intermediate / tp_size]
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, attn_backend: AttentionBackend,
        tp_rank: int, tp_size: int,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, attn_backend, tp_rank, tp_size)
        self.mlp = LlamaMLP(config, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # hidden: [T, hidden]; same order of adds as HF's LlamaDecoderLayer
        residual = hidden
        hidden = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden))
        return residual + hidden


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attn_backend, tp_rank, tp_size)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    """Llama/Mistral/Qwen2 causal LM for one tensor-parallel rank.

    `kv_caches[i]` is layer i's cache, `[2, num_blocks, block_size, num_kv_heads, head_dim]`
    with `num_kv_heads` this rank's count (the attribute below; less than the config's when
    tp_size > 1). Parameters never require grad.
    """

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
        self.config = config
        self.model = LlamaModel(config, attn_backend, tp_rank, tp_size)
        self.num_layers = config.num_hidden_layers
        # per rank: the KV cache's head count
        self.num_kv_heads, _ = kv_heads_per_rank(config.num_key_value_heads, tp_size)
        self.head_dim = config.head_dim
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final-normed hidden states [T, hidden]."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"got {len(kv_caches)} kv caches, expected one per layer "
                f"({len(self.model.layers)})"
            )
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab_size] float32 (full vocab on every rank)."""
        return self.lm_head.compute_logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the parameters (this rank's shard of each).

        Returns the names of parameters fully loaded (fused ones only once every shard came).
        Raises WeightShapeError naming the tensor on a shape mismatch, KeyError listing the
        names that match no parameter.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards_seen: dict[str, set[object]] = {}
        unknown: list[str] = []
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the output projection
            name, shard_id = _our_name(hf_name)
            param = params.get(name)
            if param is None:
                unknown.append(hf_name)
                continue
            try:
                param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
            except WeightShapeError as e:
                raise WeightShapeError(f"tensor {hf_name!r}: {e}") from None
            if shard_id is None:
                loaded.add(name)
                continue
            shards = shards_seen.setdefault(name, set())
            shards.add(shard_id)
            if len(shards) == _SHARDS_PER_PARAM[name.split(".")[-2]]:
                loaded.add(name)
        if unknown:
            raise KeyError(f"checkpoint tensors match no model parameter: {unknown}")
        return loaded


def _our_name(hf_name: str) -> tuple[str, object]:
    """Maps an HF tensor name to (our parameter name, shard id or None)."""
    for fused, part, shard_id in _STACKED:
        if f".{part}." in hf_name:
            return hf_name.replace(f".{part}.", f".{fused}."), shard_id
    return hf_name, None
