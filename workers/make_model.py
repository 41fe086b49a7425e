"""Synthetic but real checkpoints: HF config, seeded safetensors weights and a trained tokenizer.

`make_model` writes a folder that both Cleave and `transformers.AutoModelForCausalLM` load. The
weights are `workers.loader.random_weights(config, seed)`, so `load_format="dummy"` with the same
seed gives the same model without touching disk. `default_model_path()` is the embedded default
every test and `cleave generate` uses when no model is named.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from workers.loader import hf_weight_shapes, random_weight
from workers.model_config import ModelConfig, resolve_dtype

# bump when the files make_model writes change, so cached defaults are rebuilt
_FORMAT_VERSION = 2  # 2: chat templates that render tools (llama, mistral)
_DEFAULT_SHARD_BYTES = 2 * 1024**3
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# the MoE families use their dense relatives' tokenizers and chat templates (Qwen3: Qwen2's)
_TOKENIZER_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3": "qwen2",
                     "qwen3_moe": "qwen2", "phi3": "mistral",  # phi3: a Llama-2-style vocab
                     "gemma3": "gemma", "gpt_oss": "qwen2"}  # gpt-oss: ChatML, not Harmony
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


def make_model(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str | None = None,
    overrides: dict[str, Any] | None = None,
    max_shard_bytes: int = _DEFAULT_SHARD_BYTES,
    weights: bool = True,
) -> Path:
    """Writes a checkpoint folder at `out_dir` (created if needed) and returns its path.

    `dtype` overrides the preset's weight dtype; `overrides` replaces HF config.json fields
    (e.g. {"num_hidden_layers": 1}). Weights larger than `max_shard_bytes` are split into
    `model-0000i-of-0000n.safetensors` shards with an index, one shard in memory at a time.
    The same arguments give byte-identical weight and tokenizer files. `weights=False` writes
    only config and tokenizer, for serving real shapes with `load_format="dummy"` (the same
    weights `make_model` would have written for that seed).
    """
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(_ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = PRESETS[preset]
    if dtype is not None:
        shape = replace(shape, dtype=dtype)
    from workers.tokenizer.build import write_tokenizer_files

    tokenizer = write_tokenizer_files(out, arch=_TOKENIZER_FAMILY.get(arch, arch),
                                      vocab_size=shape.vocab_size)
    hf_config = _hf_config(arch, preset, shape, tokenizer, overrides or {})
    hf_config.save_pretrained(out)  # config.json
    _generation_config(hf_config).save_pretrained(out)  # generation_config.json
    if weights:
        config = ModelConfig.from_pretrained(out)
        _write_weights(out, config, seed, resolve_dtype("auto", config), max_shard_bytes)
    return out


def _hf_config(
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
        architectures=[_ARCHITECTURES[arch]],
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
    if arch == "qwen3_moe":  # renormalized top-k, no shared expert, as Qwen3-30B-A3B
        kwargs.update(num_experts=_NUM_EXPERTS, num_experts_per_tok=_TOP_K,
                      moe_intermediate_size=shape.intermediate_size // 2, norm_topk_prob=True)
    kwargs.update(overrides)
    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "mixtral": transformers.MixtralConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "phi3": transformers.Phi3Config,
        "gemma3": transformers.Gemma3TextConfig,
        "gpt_oss": transformers.GptOssConfig,
    }[arch]
    return config_class(**kwargs)


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


def _generation_config(hf_config: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=hf_config.bos_token_id,
        eos_token_id=hf_config.eos_token_id,
        pad_token_id=hf_config.pad_token_id,
    )


def _write_weights(
    out: Path, config: ModelConfig, seed: int, dtype: torch.dtype, max_shard_bytes: int
) -> None:
    shapes = hf_weight_shapes(config)
    itemsize = dtype.itemsize
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, shape in shapes:
        nbytes = itemsize * _numel(shape)
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        tensors = {n: random_weight(n, s, seed).to(dtype) for n, s in shards[0]}
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: random_weight(n, s, seed).to(dtype) for n, s in shard}
        save_file(tensors, str(out / file_name), metadata=metadata)
        del tensors
        weight_map.update((n, file_name) for n, _ in shard)
    total = sum(itemsize * _numel(s) for _, s in shapes)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def default_model_path() -> Path:
    """The embedded default (tiny llama, seed 0), built on first use and cached on disk.

    Lives under `$CLEAVE_CACHE_DIR/models/` (default `~/.cache/cleave/models/`), in a folder
    named by a hash of everything that shapes its files. Safe when processes race: each builds
    in a temp folder and renames it into place; a loser discards its copy and uses the winner's.
    """
    root = Path(os.environ.get("CLEAVE_CACHE_DIR") or Path.home() / ".cache" / "cleave")
    recipe = {"version": _FORMAT_VERSION, "arch": "llama", "seed": 0,
              "preset": asdict(PRESETS["tiny"])}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    final = root / "models" / f"tiny-llama-{digest}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        make_model(tmp, arch="llama", preset="tiny", seed=0)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
