"""A random LoRA adapter folder for a checkpoint, written as PEFT's `save_pretrained` writes one
(`adapter_config.json` + `adapter_model.safetensors`), for tests and benchmarks that need
adapters of a model made with `workers.models.make_model` (no PEFT needed). Its A and B are
drawn at random: PEFT's own start (B zero) would change nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of a dense Llama-like layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def make_adapter(model_dir: str | Path, out_dir: str | Path, *, rank: int = 8,
                 alpha: float | None = None, targets: Sequence[str] = ATTENTION,
                 seed: int = 0, scale: float = 0.1) -> Path:
    """Writes a LoRA of `rank` (alpha: 2 * rank unless given) on `targets` of every layer of
    the checkpoint at `model_dir` to `out_dir`; A and B are N(0, scale^2). Returns `out_dir`."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = _shapes(config)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"unknown target modules {unknown}; expected some of {sorted(shapes)}")
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            block = "self_attn" if name in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            n_in, n_out = shapes[name]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * scale
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": str(model_dir)}, indent=2))
    return out
