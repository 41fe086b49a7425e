"""A GGUF file's metadata as a model config: the shapes, RoPE settings and special ids
llama.cpp's converter (`convert_hf_to_gguf.py`) writes under `{arch}.*` and `tokenizer.ggml.*`,
turned into the `config.json` fields the same model's Hugging Face folder has.

Where the file is silent, llama.cpp's own defaults apply (they are what the file's writer
meant): Gemma 3's local layers take RoPE base 10,000 and every sixth layer is global, and its
attention scale is the head size's (the 27B model's, 62 layers, hidden size over heads).
A llama-family file's RoPE scaling of the Llama 3 kind comes as a `rope_freqs` tensor of
per-frequency divisors, kept as such (`RopeScaling(rope_type="freq_factors")`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from workers.models.rope_config import RopeScaling
from workers.tokenizer.gguf_file import GGUFError, GGUFMetadata, open_gguf


@dataclass(frozen=True)
class GGUFFamily:
    """How llama.cpp writes one family: its HF names, and what its converter did to tensors."""

    architecture: str  # the HF architecture ("LlamaForCausalLM")
    model_type: str  # the HF model_type ("llama")
    permuted_qk: bool  # q/k rows permuted into llama.cpp's RoPE layout (undone at load)
    norm_offset: float  # norm weights stored as HF's + this (Gemma: 1)


FAMILIES: dict[str, GGUFFamily] = {
    # "llama" also covers Llama 2/3, Mistral and SmolLM files
    "llama": GGUFFamily("LlamaForCausalLM", "llama", True, 0.0),
    "qwen2": GGUFFamily("Qwen2ForCausalLM", "qwen2", False, 0.0),
    "qwen3": GGUFFamily("Qwen3ForCausalLM", "qwen3", False, 0.0),
    "gemma3": GGUFFamily("Gemma3ForCausalLM", "gemma3_text", False, 1.0),
    "phi3": GGUFFamily("Phi3ForCausalLM", "phi3", False, 0.0),
}
ROPE_FREQS = "rope_freqs.weight"
_GEMMA3_27B_LAYERS = 62  # llama.cpp scales this one's attention by hidden / heads
_GEMMA3_PATTERN = 6  # llama.cpp's default: layers 6, 12, ... are global


class GGUFTensorInfo(NamedTuple):
    """One tensor of the file: its GGUF name, shape in PyTorch order ([out, in]), GGML type."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str  # "F32", "Q4_K", ...


def tensor_infos(reader: Any) -> dict[str, GGUFTensorInfo]:
    """The file's tensors by GGUF name (GGUF lists dimensions innermost first; reversed)."""
    return {t.name: GGUFTensorInfo(t.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                                   t.tensor_type.name) for t in reader.tensors}


def family_of(meta: GGUFMetadata) -> GGUFFamily:
    family = FAMILIES.get(meta.architecture)
    if family is None:
        raise GGUFError(f"GGUF file {str(meta.path)!r}: architecture {meta.architecture!r} is "
                        f"not supported; expected one of {sorted(FAMILIES)}")
    return family


class GGUFConfig(NamedTuple):
    """A GGUF file's model settings: `config.json`'s fields, and the RoPE scaling that has no
    `config.json` spelling (Llama 3's, as per-frequency divisors), None when there is none."""

    raw: dict[str, Any]
    rope_scaling: RopeScaling | None


def read_gguf_config(path: str | Path) -> GGUFConfig:
    """The settings of the GGUF file at `path` (`ModelConfig.from_pretrained` reads a GGUF file
    through this). Raises GGUFError naming the file and what is unsupported (architecture, a
    mixture of experts, RoPE scaling ...) or missing."""
    reader = open_gguf(path)
    meta = GGUFMetadata(reader, Path(path))
    tensors = tensor_infos(reader)
    raw = hf_config(meta, tensors)
    scaling = _freq_factors(reader, raw, path) if ROPE_FREQS in tensors else None
    return GGUFConfig(raw, scaling)


def hf_config(meta: GGUFMetadata, tensors: Mapping[str, GGUFTensorInfo]) -> dict[str, Any]:
    """The `config.json` fields (transformers' names) the file's metadata stands for."""
    family = family_of(meta)
    if meta.arch_key("expert_count", 0):
        raise GGUFError(f"GGUF file {str(meta.path)!r}: mixture-of-experts files "
                        f"({meta.architecture}.expert_count={meta.arch_key('expert_count')}) "
                        "are not supported")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"GGUF file {str(meta.path)!r} has no tensor 'token_embd.weight'")
    hidden = int(meta.arch_key("embedding_length", required=True))
    heads = int(meta.arch_key("attention.head_count", required=True))
    head_dim = int(meta.arch_key("attention.key_length") or hidden // heads)
    value_dim = int(meta.arch_key("attention.value_length") or head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"GGUF file {str(meta.path)!r}: value heads of {value_dim} != key "
                        f"heads of {head_dim} are not supported")
    rotary = int(meta.arch_key("rope.dimension_count") or head_dim)
    num_layers = int(meta.arch_key("block_count", required=True))
    raw: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_key("feed_forward_length", required=True)),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(meta, heads),
        "head_dim": head_dim,
        "partial_rotary_factor": rotary / head_dim,
        "rms_norm_eps": float(meta.arch_key("attention.layer_norm_rms_epsilon", required=True)),
        "max_position_embeddings": int(meta.arch_key("context_length", required=True)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        "mlp_bias": "blk.0.ffn_down.bias" in tensors,
        "dtype": _dtype(tensors),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
        "rope_parameters": _rope(meta, tensors),
    }
    window = meta.arch_key("attention.sliding_window")
    if family.model_type == "phi3":
        raw["sliding_window"] = int(window) if window else None
    if family.model_type == "gemma3_text":
        raw.update(_gemma3(meta, raw, window))
    return raw


def _kv_heads(meta: GGUFMetadata, heads: int) -> int:
    kv = meta.arch_key("attention.head_count_kv", heads)
    if isinstance(kv, list):  # one count per layer: only a uniform one is supported
        if len(set(kv)) != 1:
            raise GGUFError(f"GGUF file {str(meta.path)!r}: per-layer KV head counts {kv} are "
                            "not supported; expected the same count on every layer")
        kv = kv[0]
    return int(kv)


def _eos_ids(meta: GGUFMetadata) -> list[int]:
    """eos, then the end-of-turn and end-of-message ids where the file names them."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id")
    ids = [int(meta.get(key)) for key in keys if meta.get(key) is not None]
    return list(dict.fromkeys(ids))


def _dtype(tensors: Mapping[str, GGUFTensorInfo]) -> str:
    """The checkpoint dtype "auto" resolves to: the matrices' float type when they all share
    F16 or BF16, else float32 (F32 files, and quantized ones, which dequantize to fp32)."""
    kinds = {t.ggml_type for t in tensors.values() if len(t.shape) == 2}
    return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(
        frozenset(kinds), "float32")


def _rope(meta: GGUFMetadata, tensors: Mapping[str, GGUFTensorInfo]) -> dict[str, Any]:
    """transformers' `rope_parameters` for the (global layers') RoPE."""
    params: dict[str, Any] = {"rope_type": "default",
                              "rope_theta": float(meta.arch_key("rope.freq_base", 10000.0))}
    kind = meta.arch_key("rope.scaling.type")
    factor = meta.arch_key("rope.scaling.factor")
    if kind is None and meta.arch_key("rope.scale_linear"):  # older files' spelling
        kind, factor = "linear", meta.arch_key("rope.scale_linear")
    if kind in (None, "none") or (kind == "linear" and float(factor or 1.0) == 1.0):
        return params
    if kind == "linear":
        return {**params, "rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        yarn = {"rope_type": "yarn", "factor": float(factor),
                "original_max_position_embeddings": int(
                    meta.arch_key("rope.scaling.original_context_length", required=True))}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            if meta.arch_key(f"rope.scaling.{key}") is not None:
                yarn[name] = float(meta.arch_key(f"rope.scaling.{key}"))
        return {**params, **yarn}
    raise GGUFError(f"GGUF file {str(meta.path)!r}: RoPE scaling {kind!r} is not supported; "
                    "expected none, linear, yarn, or Llama 3's rope_freqs tensor")


def _gemma3(meta: GGUFMetadata, raw: Mapping[str, Any], window: Any) -> dict[str, Any]:
    """Gemma 3's own fields, with llama.cpp's defaults where the file is silent."""
    if meta.arch_key("attn_logit_softcapping") is not None:
        raise GGUFError(f"GGUF file {str(meta.path)!r}: attention logit soft-capping is not "
                        "supported (Gemma 3 has none)")
    num_layers = raw["num_hidden_layers"]
    pattern = meta.arch_key("attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if isinstance(pattern, list):  # per layer, true where the layer slides
        kinds = ["sliding_attention" if slides else "full_attention" for slides in pattern]
    else:
        kinds = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                 for i in range(num_layers)]
    scalar = (raw["hidden_size"] // raw["num_attention_heads"]
              if num_layers == _GEMMA3_27B_LAYERS else raw["head_dim"])
    local = {"rope_type": "default",
             "rope_theta": float(meta.arch_key("rope.freq_base_swa", 10000.0))}
    softcap = meta.arch_key("final_logit_softcapping")
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
            "sliding_window": int(window) if window else None, "layer_types": kinds,
            "final_logit_softcapping": None if softcap is None else float(softcap),
            "rope_parameters": {"full_attention": raw["rope_parameters"],
                                "sliding_attention": local}}


def _freq_factors(reader: Any, raw: Mapping[str, Any], path: str | Path) -> RopeScaling:
    """Llama 3's RoPE scaling as llama.cpp's converter writes it: a divisor per frequency."""
    if raw["rope_parameters"].get("rope_type", "default") != "default":
        raise GGUFError(f"GGUF file {str(path)!r}: a {ROPE_FREQS} tensor together with RoPE "
                        f"scaling {raw['rope_parameters']['rope_type']!r} is not supported")
    from gguf.quants import dequantize

    tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
    factors = tuple(float(f) for f in dequantize(tensor.data, tensor.tensor_type).reshape(-1))
    if len(factors) != raw["head_dim"] // 2:
        raise GGUFError(f"GGUF file {str(path)!r}: {ROPE_FREQS} has {len(factors)} values; "
                        f"expected head_dim / 2 = {raw['head_dim'] // 2}")
    return RopeScaling(rope_type="freq_factors", factor=1.0, freq_factors=factors)
