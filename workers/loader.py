"""Builds a model on its device and fills its parameters from safetensors files or a seeded RNG.

Checkpoints are read tensor by tensor with `safe_open` straight into the already-allocated
parameters, so peak memory is the model plus one checkpoint tensor.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from workers.attention.backend import AttentionBackend
from workers.model_config import ModelConfig
from workers.models import get_model_class
from workers.models.layers import Shard, WeightShapeError

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_MAX_NAMES_SHOWN = 5


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model: missing files, tensors or shapes that differ."""


def load_model(
    path: str | Path | None,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: AttentionBackend,
    load_format: str = "auto",
    seed: int = 0,
    tp_rank: int = 0,
    tp_size: int = 1,
    shard: Shard | None = None,
) -> nn.Module:
    """Returns the model for `config` on `device` in `dtype`, in eval mode, weights loaded.

    `load_format`: "auto"/"safetensors" read `path`; "dummy" ignores `path` and draws the weights
    `random_weights(config, seed)` would give (the ones `make_model` writes for that seed).
    `shard` (overrides tp_rank/tp_size): the TP group, pipeline stage and expert split.
    Raises WeightLoadError when the checkpoint does not fit; no half-loaded model escapes.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"unknown load_format {load_format!r}; expected one of {list(LOAD_FORMATS)}"
        )
    if load_format != "dummy":
        if path is None:
            raise ValueError(f"load_format {load_format!r} needs a model folder, got path=None")
        files = find_safetensors_files(Path(path))  # fail before allocating the model
    model_class = get_model_class(config.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config, attn_backend, shard=shard or Shard(tp_rank, tp_size))
    error: str | None = None
    try:
        with torch.no_grad():
            if load_format == "dummy":
                model.load_weights(random_weights(config, seed))
            else:
                _load_safetensors(model, files, Path(path))  # type: ignore[arg-type]
    except WeightLoadError as e:
        error = str(e)
    if error is not None:
        # raised outside the except block so no traceback keeps the half-built model alive
        del model
        raise WeightLoadError(error)
    return model.eval()


def find_safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: the index's shards, else model.safetensors, else *.safetensors."""
    if not folder.is_dir():
        raise WeightLoadError(f"model folder {str(folder)!r} does not exist")
    index = folder / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(
                f"{_INDEX_FILE} in {str(folder)!r} lists files that do not exist: {missing}"
            )
        return files
    if (folder / _SINGLE_FILE).is_file():
        return [folder / _SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(
            f"no weights in {str(folder)!r}: looked for {_INDEX_FILE}, {_SINGLE_FILE} "
            f"and *.safetensors"
        )
    return files


def _load_safetensors(model: nn.Module, files: list[Path], folder: Path) -> None:
    current: list[str] = ["", ""]  # (file, tensor) being read, for error messages

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    current[:] = [file.name, name]
                    yield name, f.get_tensor(name)

    try:
        loaded = model.load_weights(tensors())
    except WeightShapeError as e:
        raise WeightLoadError(f"{current[0]} in {str(folder)!r}: {e}") from None
    except KeyError as e:
        raise WeightLoadError(f"{str(folder)!r}: {e.args[0]}") from None
    _check_all_loaded(model, loaded, f"checkpoint {str(folder)!r}")


def _check_all_loaded(model: nn.Module, loaded: set[str], source: str) -> None:
    missing = [name for name, _ in model.named_parameters() if name not in loaded]
    if missing:
        shown = missing[:_MAX_NAMES_SHOWN]
        more = f" and {len(missing) - len(shown)} more" if len(missing) > len(shown) else ""
        raise WeightLoadError(f"{source} has no weights for parameters {shown}{more}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def hf_weight_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the HF checkpoint for `config`, in HF names and layer order."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config.vocab_size, h))
    ]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,))]
        fused = config.model_type == "phi3"  # one qkv_proj and one gate_up_proj tensor
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
        shapes.append((p + "post_attention_layernorm.weight", (h,)))
        if config.model_type == "gemma3_text":  # norms around the MLP too
            shapes += [(p + "pre_feedforward_layernorm.weight", (h,)),
                       (p + "post_feedforward_layernorm.weight", (h,))]
        if config.is_moe_layer(i):
            shapes += _moe_shapes(config, p)
            continue
        mlp = (("gate_up_proj", (2 * inter, h)),) if fused else (
            ("gate_proj", (inter, h)), ("up_proj", (inter, h)))
        mlp += (("down_proj", (h, inter)),)
        for proj, shape in mlp:
            shapes.append((f"{p}mlp.{proj}.weight", shape))
            if config.mlp_bias:
                shapes.append((f"{p}mlp.{proj}.bias", (shape[0],)))
    shapes.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (config.vocab_size, h)))
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
    for e in range(moe.num_experts):
        for name, shape in zip(names, ((i, h), (i, h), (h, i))):
            shapes.append((f"{p}{block}.experts.{e}.{name}.weight", shape))
    s = moe.shared_expert_intermediate_size
    if s:
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
    if name.endswith(".bias"):
        return torch.randn(shape, generator=generator) * 0.1
    fan_in = shape[-1]
    std = 4.0 / fan_in**0.5 if ("lm_head" in name or "embed_tokens" in name) else fan_in**-0.5
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
