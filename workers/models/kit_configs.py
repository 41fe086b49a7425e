"""The shapes `make_model` writes (presets) and the transformers config of each family at such a
shape: the structure each family ships with (GQA, RoPE scaling, MoE routing, sliding windows,
latent attention), at the preset's size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workers.models.kit_archs import KIT_ARCHS
from workers.models.model_config import ARCH_BY_MODEL_TYPE

# make-model's architecture names; each is its model_type but Gemma 3's ("gemma3_text")
ARCHITECTURES = {arch: ARCH_BY_MODEL_TYPE["gemma3_text" if arch == "gemma3" else arch]
                 for arch in KIT_ARCHS}
# the MoE families use their dense relatives' tokenizers and chat templates (Qwen3: Qwen2's)
TOKENIZER_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3": "qwen2",
                     "qwen3_moe": "qwen2", "phi3": "mistral",  # phi3: a Llama-2-style vocab
                     "gemma3": "gemma", "gpt_oss": "harmony",  # Harmony's channels
                     "deepseek_v3": "deepseek"}  # DeepSeek-R1's turns, thinking opened
# Gemma 3's local layers: a window of 512 tokens on five layers of six, as Gemma-3-1B (gpt-oss:
# 128 on every other layer); the tiny preset's window is short enough for tests to pass it
_TINY_WINDOW = {"tiny": 16}
_NUM_EXPERTS, _TOP_K = 4, 2  # every preset's MoE shape: tiny, like the parallel tests


@dataclass(frozen=True)
class Preset:
    """A model shape, in the units of HF's config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    rope_theta: float = 10000.0
    # llama only (the other families ignore it): transformers' rope_parameters scaling keys
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)


PRESETS: dict[str, Preset] = {
    # the embedded default: fast on 2 CPU cores, yet GQA and llama3 RoPE scaling like Llama 3.1
    "tiny": Preset(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, max_position_embeddings=2048, dtype="float32",
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    ),
    # ~40M parameters, for CPU benchmarks
    "small": Preset(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1408, vocab_size=8192, max_position_embeddings=4096, dtype="float32",
    ),
    # the real Meta-Llama-3-8B shape (Llama 3.1 RoPE)
    "llama-3-8b": Preset(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
        dtype="bfloat16", rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ),
}


def hf_config(
    arch: str, preset: str, shape: Preset, tokenizer: Any, overrides: dict[str, Any]
) -> Any:
    """The transformers config object (LlamaConfig, ...) for this checkpoint."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("make_model writes config.json with transformers; install it") from e
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if arch == "llama" and shape.rope_scaling:
        rope = {**shape.rope_scaling, "rope_theta": shape.rope_theta}
    stop_ids = list(tokenizer.stop_token_ids)
    kwargs: dict[str, Any] = dict(
        architectures=[ARCHITECTURES[arch]],
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=arch == "qwen2" and preset in ("tiny", "small"),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stop_ids[0] if len(stop_ids) == 1 else stop_ids,
        pad_token_id=tokenizer.pad_token_id,
        dtype=shape.dtype,
    )
    kwargs.update(_family_kwargs(arch, preset, shape, rope))
    kwargs.update(overrides)
    return getattr(transformers, _CONFIG_CLASS[arch])(**kwargs)


_CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                 "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig",
                 "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "phi3": "Phi3Config",
                 "gemma3": "Gemma3TextConfig", "gpt_oss": "GptOssConfig",
                 "deepseek_v3": "DeepseekV3Config"}


def _family_kwargs(arch: str, preset: str, shape: Preset,
                   rope: dict[str, Any]) -> dict[str, Any]:
    """What a family's config adds to (or changes in) the shared fields."""
    kwargs: dict[str, Any] = {}
    if arch in ("mistral", "mixtral", "phi3"):
        kwargs["sliding_window"] = None  # full attention, as Mistral-7B-v0.2 and later
    if arch == "mixtral":
        kwargs.update(num_local_experts=_NUM_EXPERTS, num_experts_per_tok=_TOP_K)
    if arch == "qwen2_moe":
        kwargs.update(num_experts=_NUM_EXPERTS, num_experts_per_tok=_TOP_K,
                      moe_intermediate_size=shape.intermediate_size // 2,
                      shared_expert_intermediate_size=shape.intermediate_size)
    if arch == "gemma3":
        kwargs.update(_gemma3_kwargs(preset, shape, rope))
    if arch == "gpt_oss":  # as gpt-oss-20b: YaRN x32, every other layer a 128-token window
        kwargs.update(num_local_experts=_NUM_EXPERTS, num_experts_per_tok=_TOP_K,
                      intermediate_size=shape.intermediate_size // 2,
                      sliding_window=_TINY_WINDOW.get(preset, 128),
                      rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": False,
                                       "rope_theta": 150000.0,
                                       "original_max_position_embeddings": 4096})
    if arch == "deepseek_v3":
        kwargs.update(_deepseek_kwargs(shape))
    if arch == "qwen3_moe":  # renormalized top-k, no shared expert, as Qwen3-30B-A3B
        kwargs.update(num_experts=_NUM_EXPERTS, num_experts_per_tok=_TOP_K,
                      moe_intermediate_size=shape.intermediate_size // 2, norm_topk_prob=True)
    return kwargs


def _gemma3_kwargs(preset: str, shape: Preset, rope: dict[str, Any]) -> dict[str, Any]:
    """Local layers with their own RoPE base; one global layer in six, and the last."""
    layers = shape.num_hidden_layers
    return dict(
        rope_parameters={"full_attention": rope,
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        sliding_window=_TINY_WINDOW.get(preset, 512), tie_word_embeddings=True,
        query_pre_attn_scalar=shape.hidden_size // shape.num_attention_heads,
        layer_types=["full_attention" if (i + 1) % 6 == 0 or i == layers - 1
                     else "sliding_attention" for i in range(layers)])


def _deepseek_kwargs(shape: Preset) -> dict[str, Any]:
    """DeepSeek-V3's structure at the preset's size: latent attention (a cached latent of a
    quarter of the hidden size, at least 64, its RoPE part half a head), a dense first layer,
    then experts in two groups (one chosen) with a shared expert, YaRN with its softmax
    mscale."""
    head = shape.hidden_size // shape.num_attention_heads
    rope = head // 2
    return dict(
        num_key_value_heads=shape.num_attention_heads,
        kv_lora_rank=max(64, shape.hidden_size // 4) - rope, q_lora_rank=shape.hidden_size // 2,
        qk_rope_head_dim=rope, qk_nope_head_dim=head - rope,
        v_head_dim=head, head_dim=rope, n_routed_experts=_NUM_EXPERTS, n_shared_experts=1,
        num_experts_per_tok=_TOP_K, n_group=2, topk_group=1, first_k_dense_replace=1,
        moe_intermediate_size=shape.intermediate_size // 2,
        rope_parameters={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": shape.rope_theta,
                         "original_max_position_embeddings": shape.max_position_embeddings})
