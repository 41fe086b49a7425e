"""The model's shape and numerics, read from a Hugging Face checkpoint folder.

Both spellings of the RoPE settings are accepted and normalized to the same `ModelConfig`:
transformers < 5 writes `rope_theta` plus `rope_scaling` (keyed `type` or `rope_type`),
transformers 5 writes one `rope_parameters` dict (`rope_type`, `rope_theta`, scaling keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "Phi3ForCausalLM")
# configs written by `XConfig.save_pretrained` (no model) have no `architectures` key
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_DEFAULT_ROPE_THETA = 10000.0
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class RopeScaling:
    """Non-default RoPE frequency scaling, as transformers' `modeling_rope_utils` applies it."""

    rope_type: str  # "linear" or "llama3"
    factor: float
    # llama3 only
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MoE block of Mixtral / Qwen2-MoE, in the HF config's terms."""

    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts each token goes to
    intermediate_size: int  # per routed expert
    norm_topk_prob: bool  # renormalize the top-k probabilities (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert, 0 for none
    decoder_sparse_step: int = 1  # every n-th layer is sparse (Qwen2-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # layers kept dense (Qwen2-MoE)


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
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE (Qwen3)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when layer `layer_idx` has a sparse MoE block instead of a dense MLP."""
        moe = self.moe
        return (moe is not None and layer_idx not in moe.mlp_only_layers
                and (layer_idx + 1) % moe.decoder_sparse_step == 0)

    @property
    def o_proj_bias(self) -> bool:
        # Llama and Qwen3 apply `attention_bias` to o_proj too; Qwen2 never has an o_proj bias
        return self.attention_bias and self.model_type in ("llama", "qwen3", "qwen3_moe")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Reads `config.json` (and `generation_config.json` for extra eos ids) in folder `path`."""
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
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; expected 'silu'")
        rope_theta, rope_scaling = _rope(raw)
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
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(raw, model_type),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(eos)),  # dedup, keep order
            sliding_window=_sliding_window(raw, model_type),
            moe=_moe(raw, model_type),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
        )


def _architecture(raw: Mapping[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if architectures:
        architecture = architectures[0]
    else:
        architecture = _ARCH_BY_MODEL_TYPE.get(raw.get("model_type", ""), "")
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
    if model_type == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    return bool(raw.get("attention_bias", False))


def _moe(raw: Mapping[str, Any], model_type: str) -> MoEConfig | None:
    if model_type == "mixtral":
        return MoEConfig(num_experts=int(raw["num_local_experts"]),
                         top_k=int(raw["num_experts_per_tok"]),
                         intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    if model_type in ("qwen2_moe", "qwen3_moe"):  # Qwen3-MoE: no shared expert
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the hub's
        # configs (and Qwen2-MoE's) as num_experts
        return MoEConfig(
            num_experts=int(raw.get("num_experts") or raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
            decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()))
    return None


def _model_type_of(architecture: str) -> str:
    return {arch: mt for mt, arch in _ARCH_BY_MODEL_TYPE.items()}[architecture]


def _rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """Merges `rope_parameters` (transformers 5) and `rope_theta`/`rope_scaling` (older)."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_ROPE_THETA))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0
    if float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported; RoPE must cover "
                         "the whole head (1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        original = params.get(
            "original_max_position_embeddings", raw.get("max_position_embeddings", 2048)
        )
        return float(theta), RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    raise ValueError(
        f"unsupported rope type {rope_type!r}; expected one of ['default', 'linear', 'llama3']"
    )


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
    return int(window)


def resolve_dtype(name_or_dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """Maps a user's dtype name to a torch dtype; "auto" is the checkpoint's own (fp32 if unset)."""
    if isinstance(name_or_dtype, torch.dtype):
        if name_or_dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {name_or_dtype}; expected one of {_allowed()}")
        return name_or_dtype
    name = name_or_dtype.lower().removeprefix("torch.")
    if name == "auto":
        if config.torch_dtype is None:
            return torch.float32
        name = config.torch_dtype.lower().removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(
                f"checkpoint dtype {config.torch_dtype!r} is not supported; "
                f"pass one of {_allowed()}"
            )
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name_or_dtype!r}; expected one of {_allowed()}")
    return _DTYPES[name]


def _allowed() -> list[str]:
    return ["auto", *_DTYPES]
