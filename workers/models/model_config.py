"""The model's shape and numerics, read from a Hugging Face checkpoint folder.

Every spelling of the RoPE settings on the hub is accepted (`workers.models.rope_config`) and
normalized to the same `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.models.mla_config import MLAConfig, parse_mla
from workers.models.moe_config import MoEConfig, parse_moe
from workers.quant.scheme import QuantScheme, parse_quantization
from workers.models.rope_config import RopeScaling, layer_types, parse_local_rope, parse_rope
from workers.models.gguf_config import read_gguf_config
from workers.tokenizer.gguf_file import GGUFError, find_gguf_file

# configs written by `XConfig.save_pretrained` (no model) have no `architectures` key
ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(ARCH_BY_MODEL_TYPE.values())
_DEFAULT_THETA = {"gemma3_text": 1_000_000.0, "gpt_oss": 150_000.0}
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")

@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to build a decoder-only model. Immutable."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None for the plain ("default") RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2: always); o_proj follows it for Llama only
    mlp_bias: bool
    torch_dtype: str | None  # the checkpoint's own dtype name ("bfloat16"), None if unstated
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None  # tokens each query may see, None for full attention
    moe: MoEConfig | None = None  # None for dense models
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" or "gelu_pytorch_tanh"
    # per layer, "sliding_attention" or "full_attention"; () when every layer is alike (then
    # `sliding_window`, if set, applies to all of them, as in Mistral)
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of the sliding layers, if their own
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attention_sinks: bool = False  # a learned sink logit per head (gpt-oss)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V3)
    quantization: QuantScheme | None = None  # how the checkpoint stores its weights
    # DeepSeek-V3's MTP layers (`model.layers.{num_hidden_layers + i}.*`); those built: mtp_layers
    num_nextn_predict_layers: int = 0
    mtp_layers: int = 0

    @property
    def kv_cache_heads(self) -> int:
        """KV heads of the cache: the model's, or one latent per token under MLA."""
        return 1 if self.mla is not None else self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        return self.mla.latent_dim if self.mla is not None else self.head_dim

    def is_sliding(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` attends over a sliding window."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer_idx] == "sliding_attention"

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has one (then older blocks can be returned), else None."""
        layers = range(self.num_hidden_layers)
        return self.sliding_window if all(self.is_sliding(i) for i in layers) else None

    def window_of(self, layer_idx: int) -> int | None:
        """Layer `layer_idx`'s sliding window in tokens, None for full attention."""
        return self.sliding_window if self.is_sliding(layer_idx) else None

    def rope_of(self, layer_idx: int) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) of layer `layer_idx`'s RoPE."""
        if self.local_rope_theta is not None and self.is_sliding(layer_idx):
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when layer `layer_idx` has a sparse MoE block instead of a dense MLP."""
        moe = self.moe
        return (moe is not None and layer_idx not in moe.mlp_only_layers
                and (layer_idx + 1) % moe.decoder_sparse_step == 0)

    @property
    def o_proj_bias(self) -> bool:
        # Llama and Qwen3 apply `attention_bias` to o_proj too; Qwen2 never has an o_proj bias
        return self.attention_bias and self.model_type in ("llama", "qwen3", "qwen3_moe",
                                                           "gpt_oss")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Reads `config.json` (and `generation_config.json` for extra eos ids) in folder `path`,
        or the metadata of the GGUF file `path` names (`workers.models.gguf_config`)."""
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            gguf = read_gguf_config(gguf_file)
            try:
                config = cls.from_dict(gguf.raw)
            except ValueError as e:
                raise GGUFError(f"GGUF file {str(gguf_file)!r}: {e}") from None
            return (config if gguf.rope_scaling is None
                    else dataclasses.replace(config, rope_scaling=gguf.rope_scaling))
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {str(folder)!r}")
        raw = json.loads(config_file.read_text())
        generation_file = folder / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Builds from the parsed `config.json` (and optional `generation_config.json`)."""
        missing = [key for key in _REQUIRED_KEYS if raw.get(key) is None]
        if missing:
            raise ValueError(f"config.json lacks required fields {missing}")
        architecture = _architecture(raw)
        model_type = raw.get("model_type") or _model_type_of(architecture)
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads != 0:
            raise ValueError(
                f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}"
            )
        hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; expected one of "
                             f"{list(_ACTIVATIONS)}")
        gemma = model_type == "gemma3_text"
        rope = parse_rope(raw, _DEFAULT_THETA.get(model_type, 10_000.0))
        num_layers = int(raw["num_hidden_layers"])
        generation = generation or {}
        eos = _token_ids(raw.get("eos_token_id")) + _token_ids(generation.get("eos_token_id"))
        bos = raw.get("bos_token_id")
        if bos is None:
            bos = generation.get("bos_token_id")
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # DeepSeek's head_dim is its RoPE part, as transformers sets it (MLA reads `mla`)
            head_dim=int(raw.get("head_dim") or raw.get("qk_rope_head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(raw, model_type),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(eos)),  # dedup, keep order
            sliding_window=_sliding_window(raw, model_type),
            moe=parse_moe(raw, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            hidden_act=hidden_act,
            final_logit_softcapping=_optional_float(raw.get("final_logit_softcapping")),
            **(_gemma3(raw, num_layers) if gemma else {}),
            **(_gpt_oss(raw, num_layers) if model_type == "gpt_oss" else {}),
            mla=parse_mla(raw, model_type) if model_type.startswith("deepseek") else None,
            quantization=parse_quantization(raw),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0)
            if model_type == "deepseek_v3" else 0,
        )


def _architecture(raw: Mapping[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if architectures:
        architecture = architectures[0]
    else:
        architecture = ARCH_BY_MODEL_TYPE.get(raw.get("model_type", ""), "")
        if not architecture:
            raise ValueError(
                f"config.json has no 'architectures' and an unsupported model_type "
                f"{raw.get('model_type')!r}; "
                f"supported architectures: {list(SUPPORTED_ARCHITECTURES)}"
            )
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported architectures: {list(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def _attention_bias(raw: Mapping[str, Any], model_type: str) -> bool:
    if model_type == "qwen2":
        return True
    if model_type == "gpt_oss":
        return bool(raw.get("attention_bias", True))
    if model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    return bool(raw.get("attention_bias", False))


def _model_type_of(architecture: str) -> str:
    return {arch: mt for mt, arch in ARCH_BY_MODEL_TYPE.items()}[architecture]


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _sliding_window(raw: Mapping[str, Any], model_type: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if (model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
            and not raw.get("use_sliding_window", False)):
        return None  # Qwen2 and Qwen3 write a window but only apply it when this flag is set
    if model_type == "llama":
        return None
    if int(window) < 1:
        raise ValueError(f"sliding_window={window} must be a positive number of tokens "
                         "(or null for full attention)")
    return int(window)


def _gpt_oss(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """gpt-oss's own fields: sliding and full layers alternating, learned attention sinks."""
    return {"layer_types": layer_types(raw, num_layers, 2), "attention_sinks": True}


def _gemma3(raw: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Gemma 3's own fields: local/global layers, the local RoPE base, the attention scale."""
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError(f"attn_logit_softcapping={raw['attn_logit_softcapping']} is not "
                         "supported; expected null (as Gemma 3 ships)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true (an embedding model) is not "
                         "supported; expected a causal language model")
    return dict(layer_types=layer_types(raw, num_layers, 6),
                local_rope_theta=parse_local_rope(raw, 10_000.0).theta,
                query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


__all__ = ["SUPPORTED_ARCHITECTURES", "MLAConfig", "MoEConfig", "ModelConfig", "RopeScaling"]
