from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.models.dtypes import resolve_dtype
from workers.models.model_config import ModelConfig, RopeScaling
from workers.models.rotary import compute_inv_freq

transformers = pytest.importorskip("transformers")

SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
)
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 1024}


def write_config(folder: Path, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def legacy_llama_config(**overrides: Any) -> dict[str, Any]:
    """A config.json as transformers 4.x wrote it: rope_theta + rope_scaling."""
    raw = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE,
        "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }
    raw.update(overrides)
    return raw


def test_transformers5_and_legacy_spellings_parse_the_same(tmp_path: Path) -> None:
    transformers.LlamaConfig(
        **SHAPE, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING},
        dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    ).save_pretrained(tmp_path / "new")
    written = json.loads((tmp_path / "new" / "config.json").read_text())
    assert "rope_parameters" in written and "rope_scaling" not in written  # what v5 writes
    new = ModelConfig.from_pretrained(tmp_path / "new")
    old = ModelConfig.from_pretrained(write_config(tmp_path / "old", legacy_llama_config()))
    old_type_key = ModelConfig.from_pretrained(write_config(
        tmp_path / "old2",
        legacy_llama_config(rope_scaling={"type": "llama3", **LLAMA3_SCALING}),
    ))
    assert new == old == old_type_key
    assert new.rope_theta == 500000.0
    assert new.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
    assert new.torch_dtype == "bfloat16"
    assert (new.head_dim, new.num_key_value_heads) == (16, 2)


def test_linear_and_default_rope(tmp_path: Path) -> None:
    linear = ModelConfig.from_dict(legacy_llama_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert linear.rope_scaling == RopeScaling("linear", 2.0)
    default = ModelConfig.from_dict(legacy_llama_config(rope_scaling=None, rope_theta=10000.0))
    assert default.rope_scaling is None and default.rope_theta == 10000.0
    with pytest.raises(ValueError, match="'dynamic'.*default.*linear.*llama3.*yarn"):
        ModelConfig.from_dict(legacy_llama_config(rope_scaling={"rope_type": "dynamic",
                                                                "factor": 4.0}))


YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 256}  # as gpt-oss ships


@pytest.mark.parametrize("yarn", [YARN, {**YARN, "truncate": True},
                                  {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
                                  {**YARN, "attention_factor": 1.5}])
def test_yarn_matches_transformers(yarn: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workers.models.rotary import RotaryEmbedding

    hf_config = transformers.LlamaConfig(**SHAPE, head_dim=16,
                                         rope_parameters={**yarn, "rope_theta": 150000.0})
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    config = ModelConfig.from_dict({**legacy_llama_config(), "rope_theta": 150000.0,
                                    "rope_scaling": yarn, "head_dim": 16})
    scaling = config.rope_scaling
    assert scaling is not None and scaling.attention_factor == pytest.approx(factor, abs=1e-12)
    torch.testing.assert_close(compute_inv_freq(16, 150000.0, scaling), expected, rtol=0, atol=0)
    rope = RotaryEmbedding(16, 64, 150000.0, scaling)  # cos and sin carry the factor
    torch.testing.assert_close(rope.cos_sin_cache[3, :8], (3 * expected).cos() * factor)
    torch.testing.assert_close(rope.cos_sin_cache[3, 8:], (3 * expected).sin() * factor)


@pytest.mark.parametrize("scaling", [None, RopeScaling("linear", 4.0),
                                     RopeScaling("llama3", 8.0, 1.0, 4.0, 256)])
def test_inv_freq_matches_transformers(scaling: RopeScaling | None) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 500000.0}
    if scaling is not None:
        rope = {k: v for k, v in vars(scaling).items()
                if v is not None and k not in ("truncate", "attention_factor")}
        rope |= {"rope_theta": 500000.0}
    hf_config = transformers.LlamaConfig(**SHAPE, rope_parameters=rope)
    if scaling is None:
        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling.rope_type](hf_config)
    ours = compute_inv_freq(16, 500000.0, scaling)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_architecture_from_model_type_when_architectures_missing(tmp_path: Path) -> None:
    transformers.Qwen2Config(**SHAPE).save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.architecture == "Qwen2ForCausalLM"
    assert config.attention_bias  # Qwen2 always has q/k/v bias
    assert config.sliding_window is None  # written, but use_sliding_window is false


def test_mistral_sliding_window_is_kept(tmp_path: Path) -> None:
    transformers.MistralConfig(**SHAPE, sliding_window=4096).save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.architecture, config.sliding_window, config.attention_bias) == (
        "MistralForCausalLM", 4096, False)


def test_eos_ids_merge_config_and_generation_config(tmp_path: Path) -> None:
    folder = write_config(tmp_path, legacy_llama_config(eos_token_id=[2, 7]),
                          generation={"eos_token_id": [7, 9], "bos_token_id": 1})
    assert ModelConfig.from_pretrained(folder).eos_token_ids == (2, 7, 9)
    assert ModelConfig.from_dict(legacy_llama_config(eos_token_id=None)).eos_token_ids == ()


def test_defaults_for_missing_optional_fields() -> None:
    raw = legacy_llama_config()
    for key in ("num_key_value_heads", "rope_scaling", "rope_theta", "torch_dtype"):
        raw.pop(key)
    config = ModelConfig.from_dict(raw)
    assert config.num_key_value_heads == config.num_attention_heads == 4
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.torch_dtype is None


def test_unsupported_architecture_is_named() -> None:
    raw = legacy_llama_config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        ModelConfig.from_dict(raw)


def test_missing_required_field_is_named() -> None:
    raw = legacy_llama_config()
    del raw["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_dict(raw)


def test_missing_config_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        ModelConfig.from_pretrained(tmp_path)


def test_resolve_dtype() -> None:
    bf16 = ModelConfig.from_dict(legacy_llama_config())
    unstated = ModelConfig.from_dict(legacy_llama_config(torch_dtype=None))
    v5 = ModelConfig.from_dict(legacy_llama_config(torch_dtype=None, dtype="float16"))
    assert resolve_dtype("auto", bf16) == torch.bfloat16
    assert resolve_dtype("auto", unstated) == torch.float32
    assert resolve_dtype("auto", v5) == torch.float16
    for names, dtype in ((("float32", "fp32"), torch.float32),
                         (("bfloat16", "bf16"), torch.bfloat16),
                         (("float16", "fp16", "half"), torch.float16)):
        assert all(resolve_dtype(name, bf16) == dtype for name in names)
    assert resolve_dtype(torch.float16, bf16) == torch.float16
    with pytest.raises(ValueError, match="'int8'.*auto.*bfloat16"):
        resolve_dtype("int8", bf16)


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_partial_rotary_is_refused_by_name(where: str) -> None:
    """Phi-3-small and others rotate only part of each head; the engine rotates all of it, so
    such a checkpoint must fail to load rather than give wrong logits."""
    raw = legacy_llama_config(architectures=["Phi3ForCausalLM"])
    if where == "top":
        raw["partial_rotary_factor"] = 0.5
    else:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not supported"):
        ModelConfig.from_dict(raw)
    raw.pop("partial_rotary_factor", None)
    raw.pop("rope_parameters", None)
    assert ModelConfig.from_dict(raw).architecture == "Phi3ForCausalLM"


def parsed_both_ways(raw: dict[str, Any], config_class: str, folder: Path) -> ModelConfig:
    """`raw` as the hub has it, parsed; asserts transformers 5's re-save of it (its own
    spellings) parses the same."""
    legacy = ModelConfig.from_dict(raw)
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    getattr(transformers, config_class)(**kwargs).save_pretrained(folder)
    assert ModelConfig.from_pretrained(folder) == legacy
    return legacy


# Gemma-3-1B's config.json as the hub has it (transformers 4.50): local RoPE base and the
# local/global pattern spelled as rope_local_base_freq and sliding_window_pattern
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
    "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
    "sliding_window_pattern": 6, "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": [1, 106],
}


@pytest.mark.parametrize("rope_scaling", [None, {"factor": 8.0, "rope_type": "linear"}])
def test_gemma3_hub_and_transformers5_spellings_parse_the_same(tmp_path: Path, rope_scaling):
    new = parsed_both_ways({**GEMMA3_1B, "rope_scaling": rope_scaling}, "Gemma3TextConfig",
                           tmp_path)
    assert "layer_types" in json.loads((tmp_path / "config.json").read_text())
    assert [new.window_of(i) for i in range(12)] == [512] * 5 + [None] + [512] * 5 + [None]
    scaling = None if rope_scaling is None else RopeScaling("linear", 8.0)
    assert new.rope_of(0) == (10000.0, None)  # local layers: their own base, never scaled
    assert new.rope_of(5) == (1_000_000.0, scaling)  # global layers carry the scaling
    assert new.attention_scale == 256 ** -0.5 and new.qk_norm
    assert new.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize("change,message", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"sliding_window": 0}, "sliding_window=0 must be a positive number"),
    ({"layer_types": ["sliding_attention"] * 25 + ["chunked_attention"]},
     "layer_types must list one of"),
    ({"hidden_activation": "relu"}, "hidden_act 'relu' is not supported"),
])
def test_gemma3_settings_cleave_cannot_run_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**GEMMA3_1B, **change})


# gpt-oss-20b's config.json as OpenAI publishes it (MXFP4 experts), less its layer list
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "experts_per_token": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "rms_norm_eps": 1e-5, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"],
                            "quant_method": "mxfp4"},
}


def test_gpt_oss_bf16_config_parses_as_transformers_reads_it(tmp_path: Path):
    raw = {k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"}
    legacy = parsed_both_ways(raw, "GptOssConfig", tmp_path)
    assert [legacy.window_of(i) for i in range(4)] == [128, None, 128, None]
    scaling = legacy.rope_scaling
    assert scaling is not None and scaling.rope_type == "yarn" and not scaling.truncate
    assert scaling.attention_factor == pytest.approx(0.1 * math.log(32) + 1)
    moe = legacy.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (32, 4, 2880)
    assert moe.softmax_after_topk and moe.bias and moe.clamped_swiglu == (1.702, 7.0)
    assert legacy.attention_sinks and legacy.attention_bias and legacy.o_proj_bias


# DeepSeek-V3's config.json as published (FP8 weights), rope_scaling spelled with "type"
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}


def test_mxfp4_checkpoints_are_refused_naming_their_method():
    with pytest.raises(ValueError, match="quant_method 'mxfp4' is not supported"):
        ModelConfig.from_dict(GPT_OSS_20B)


def test_deepseek_v3_fp8_blocks_are_read_from_its_config():
    scheme = ModelConfig.from_dict(DEEPSEEK_V3).quantization
    assert scheme is not None and (scheme.kind, scheme.block) == ("fp8", (128, 128))
    assert scheme.fp8_scale_name == "weight_scale_inv"


def test_deepseek_v3_config_parses_as_transformers_reads_it(tmp_path: Path):
    raw = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
    legacy = parsed_both_ways(raw, "DeepseekV3Config", tmp_path)
    mla, moe = legacy.mla, legacy.moe
    assert mla is not None and mla.latent_dim == 576 and mla.q_lora_rank == 1536
    assert (legacy.kv_cache_heads, legacy.kv_cache_head_dim) == (1, 576)
    assert moe is not None and moe.groups == (8, 4) and moe.routed_scaling_factor == 2.5
    assert moe.mlp_only_layers == (0, 1, 2) and moe.shared_expert_intermediate_size == 2048
    scaling = legacy.rope_scaling
    assert scaling is not None and scaling.rope_type == "yarn"
    assert scaling.softmax_mscale() == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    # what one token's KV costs per layer: the latent against per-head keys and values
    per_head = 128 * (128 + 64 + 128)
    assert per_head / mla.latent_dim == pytest.approx(71.1, abs=0.1)


def test_deepseek_routing_other_than_v3s_is_refused():
    with pytest.raises(ValueError, match="scoring_func 'softmax'"):
        ModelConfig.from_dict({**DEEPSEEK_V3, "quantization_config": None,
                               "scoring_func": "softmax"})


# DeepSeek-V2-Lite's config.json: no low-rank query, softmax greedy routing
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 1408, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400,
}


def test_deepseek_v2_lite_config_parses_as_transformers_reads_it(tmp_path: Path):
    legacy = parsed_both_ways(DEEPSEEK_V2_LITE, "DeepseekV2Config", tmp_path)
    mla, moe = legacy.mla, legacy.moe
    assert mla is not None and mla.q_lora_rank is None and mla.rope_interleave
    assert moe is not None and moe.deepseek_scoring == "softmax" and moe.groups is None
    assert not moe.norm_topk_prob and moe.shared_expert_intermediate_size == 2 * 1408
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not supported"):
        ModelConfig.from_dict({**DEEPSEEK_V2_LITE, "topk_method": "noaux_tc"})
