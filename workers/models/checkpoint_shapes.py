"""The tensors of a Hugging Face checkpoint of each supported family (names and shapes), and
seeded random weights for them: what `make_model` writes and `load_format="dummy"` loads."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from workers.models.model_config import ModelConfig


def hf_weight_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the HF checkpoint for `config`, in HF names and layer order."""
    h = config.hidden_size
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config.vocab_size, h))
    ]
    for i in range(config.num_hidden_layers):
        shapes += _layer_shapes(config, i)
    for i in range(config.num_hidden_layers,
                   config.num_hidden_layers + config.num_nextn_predict_layers):
        shapes += _mtp_shapes(config, i)
    shapes.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (config.vocab_size, h)))
    return shapes


def _layer_shapes(config: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """Decoder layer `i`'s tensors: its norms, attention and MLP (or experts)."""
    h, inter = config.hidden_size, config.intermediate_size
    fused = config.model_type == "phi3"  # one qkv_proj and one gate_up_proj tensor
    p = f"model.layers.{i}."
    shapes: list[tuple[str, tuple[int, ...]]] = [(p + "input_layernorm.weight", (h,))]
    shapes += _mla_shapes(config, p) if config.mla else _attention_shapes(config, p)
    shapes.append((p + "post_attention_layernorm.weight", (h,)))
    if config.model_type == "gemma3_text":  # norms around the MLP too
        shapes += [(p + "pre_feedforward_layernorm.weight", (h,)),
                   (p + "post_feedforward_layernorm.weight", (h,))]
    if config.is_moe_layer(i):
        return shapes + _moe_shapes(config, p)
    mlp: tuple[tuple[str, tuple[int, int]], ...] = (
        (("gate_up_proj", (2 * inter, h)),) if fused
        else (("gate_proj", (inter, h)), ("up_proj", (inter, h))))
    mlp += (("down_proj", (h, inter)),)
    for proj, shape in mlp:
        shapes.append((f"{p}mlp.{proj}.weight", shape))
        if config.mlp_bias:
            shapes.append((f"{p}mlp.{proj}.bias", (shape[0],)))
    return shapes


def _mtp_shapes(config: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """DeepSeek-V3's multi-token-prediction layer `i` (past the decoder stack): its own copy
    of the embedding, the norms of the embedding and of the hidden state it takes, their
    projection, a decoder layer, and its output head's norm and projection."""
    h, v, p = config.hidden_size, config.vocab_size, f"model.layers.{i}."
    return [(p + "embed_tokens.weight", (v, h)), (p + "enorm.weight", (h,)),
            (p + "hnorm.weight", (h,)), (p + "eh_proj.weight", (h, 2 * h)),
            *_layer_shapes(config, i), (p + "shared_head.norm.weight", (h,)),
            (p + "shared_head.head.weight", (v, h))]


def _attention_shapes(config: ModelConfig, p: str) -> list[tuple[str, tuple[int, ...]]]:
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: list[tuple[str, tuple[int, ...]]] = []
    fused = config.model_type == "phi3"
    for proj, rows in ((("qkv_proj", q + 2 * kv),) if fused else (
            ("q_proj", q), ("k_proj", kv), ("v_proj", kv))):
        shapes.append((f"{p}self_attn.{proj}.weight", (rows, h)))
        if config.attention_bias:
            shapes.append((f"{p}self_attn.{proj}.bias", (rows,)))
    shapes.append((p + "self_attn.o_proj.weight", (h, q)))
    if config.o_proj_bias:
        shapes.append((p + "self_attn.o_proj.bias", (h,)))
    if config.qk_norm:
        shapes += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
    if config.attention_sinks:
        shapes.append((p + "self_attn.sinks", (config.num_attention_heads,)))
    return shapes


def _mla_shapes(config: ModelConfig, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """DeepSeek's latent attention: low-rank query (or one q_proj), the KV latent's down- and
    up-projections, their norms."""
    mla, h, heads = config.mla, config.hidden_size, config.num_attention_heads
    assert mla is not None
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    a = f"{p}self_attn."
    shapes: list[tuple[str, tuple[int, ...]]]
    if mla.q_lora_rank is None:
        shapes = [(a + "q_proj.weight", (heads * qk, h))]
    else:
        shapes = [(a + "q_a_proj.weight", (mla.q_lora_rank, h)),
                  (a + "q_a_layernorm.weight", (mla.q_lora_rank,)),
                  (a + "q_b_proj.weight", (heads * qk, mla.q_lora_rank))]
    shapes += [(a + "kv_a_proj_with_mqa.weight", (mla.latent_dim, h)),
               (a + "kv_a_layernorm.weight", (mla.kv_lora_rank,)),
               (a + "kv_b_proj.weight", (heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                         mla.kv_lora_rank)),
               (a + "o_proj.weight", (h, heads * mla.v_head_dim))]
    return shapes


def _moe_shapes(config: ModelConfig, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """A sparse MoE layer's tensors under HF's names (Mixtral w1/w2/w3, Qwen2-MoE *_proj)."""
    moe, h = config.moe, config.hidden_size
    if moe is None:
        raise ValueError(f"{config.architecture} has no MoE settings")
    i = moe.intermediate_size
    e = moe.num_experts
    if config.model_type == "gpt_oss":  # stacked experts, gate and up interleaved
        return [(f"{p}mlp.router.weight", (e, h)), (f"{p}mlp.router.bias", (e,)),
                (f"{p}mlp.experts.gate_up_proj", (e, h, 2 * i)),
                (f"{p}mlp.experts.gate_up_proj_bias", (e, 2 * i)),
                (f"{p}mlp.experts.down_proj", (e, i, h)),
                (f"{p}mlp.experts.down_proj_bias", (e, h))]
    mixtral = config.model_type == "mixtral"
    block = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    shapes: list[tuple[str, tuple[int, ...]]] = [(f"{p}{block}.gate.weight", (moe.num_experts, h))]
    if moe.deepseek_scoring == "sigmoid":  # DeepSeek-V3: the router's correction bias
        shapes.append((f"{p}mlp.gate.e_score_correction_bias", (moe.num_experts,)))
    for e in range(moe.num_experts):
        for name, shape in zip(names, ((i, h), (i, h), (h, i))):
            shapes.append((f"{p}{block}.experts.{e}.{name}.weight", shape))
    s = moe.shared_expert_intermediate_size
    if s and moe.deepseek_scoring is not None:  # DeepSeek: ungated shared experts
        for name, shape in zip(names, ((s, h), (s, h), (h, s))):
            shapes.append((f"{p}mlp.shared_experts.{name}.weight", shape))
    elif s:
        for name, shape in zip(names, ((s, h), (s, h), (h, s))):
            shapes.append((f"{p}mlp.shared_expert.{name}.weight", shape))
        shapes.append((f"{p}mlp.shared_expert_gate.weight", (1, h)))
    return shapes


def random_weight(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One seeded fp32 CPU tensor; the same for the same (name, shape, seed) on every machine.

    Norm weights are ones and biases small. Matrices have std 1/sqrt(fan_in), which keeps
    activations O(1), except the output projection (std 4/sqrt(hidden)) so logits spread by a
    few units and greedy argmax is far from ties. Tied embeddings use that output scale too.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    tensor_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
    generator = torch.Generator().manual_seed(tensor_seed)
    if name.endswith("bias"):  # ".bias", gpt-oss's "_proj_bias", DeepSeek's correction bias
        return torch.randn(shape, generator=generator) * 0.1
    fan_in = shape[-1]
    head = any(part in name for part in ("lm_head", "embed_tokens", "shared_head.head"))
    std = 4.0 / fan_in**0.5 if head else fan_in**-0.5
    return torch.randn(shape, generator=generator) * std


def random_weights(config: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, seeded fp32 CPU tensor) for every checkpoint tensor, one at a time.
    Gemma's norms store their offset from one, so theirs are zeros (a scale of one)."""
    offset_norms = config.model_type == "gemma3_text"
    for name, shape in hf_weight_shapes(config):
        if offset_norms and name.endswith("norm.weight"):
            yield name, torch.zeros(shape)
        else:
            yield name, random_weight(name, shape, seed)
