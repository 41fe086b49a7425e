"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`, as
`save_pretrained` writes it) read and checked against the model it is to run on.

Everything is read and validated before anything is kept: a bad adapter raises
`LoraAdapterError` naming what is wrong (a missing file, an unknown target module, a rank over
the limit, a tensor whose shape does not fit the base model, a PEFT feature not supported) and
leaves nothing behind. LoRA on an MoE's experts (PEFT's `target_parameters`) is read by
`workers.models.lora.experts`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.models.lora.experts import (ExpertLoraError, ExpertPair, ExpertShape,
                                         expert_keys, expert_pair)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$")


class LoraAdapterError(ValueError):
    """An adapter folder that cannot be served on this model; the message says why."""


@dataclass(frozen=True)
class TargetShape:
    """One PEFT module of the base model a LoRA may target: its features."""

    in_features: int
    out_features: int


@dataclass(frozen=True)
class AdapterWeights:
    """A checked adapter: per HF module path ("model.layers.0.self_attn.q_proj"), its A [r, in]
    and its B [out, r] with the scaling folded in, in the model's dtype, on the host."""

    name: str
    path: str
    rank: int
    scaling: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # per HF experts module path ("model.layers.0.mlp.experts"), per parameter ("gate_up_proj",
    # "down_proj"): its experts' A [E, r, in] and scaled B [E, out, r] (`lora.experts`)
    experts: dict[str, dict[str, ExpertPair]] = field(default_factory=dict)


def _config(folder: Path, name: str) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoraAdapterError(f"adapter {name!r}: {file} is missing (not a PEFT adapter folder)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise LoraAdapterError(f"adapter {name!r}: {file} is not JSON: {e}") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraAdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r} is not "
                               "LORA")
    unsupported = {"use_dora": bool(config.get("use_dora")),
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "rank_pattern": bool(config.get("rank_pattern")),
                   "alpha_pattern": bool(config.get("alpha_pattern")),
                   "bias": config.get("bias", "none") != "none"}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise LoraAdapterError(f"adapter {name!r}: {', '.join(bad)} in {CONFIG_FILE} "
                               "not supported (plain LoRA on linear projections only)")
    return config


def _check_targets(config: dict, name: str, known: set[str]) -> None:
    targets = config.get("target_modules")
    if not targets and config.get("target_parameters"):
        return  # experts only
    if isinstance(targets, str) or not targets:
        raise LoraAdapterError(f"adapter {name!r}: target_modules must be a list of module "
                               f"names, got {targets!r}")
    unknown = sorted(set(targets) - known)
    if unknown:
        raise LoraAdapterError(f"adapter {name!r}: unknown target module(s) {unknown}; this "
                               f"model takes LoRA on {sorted(known)}")


def read_adapter(name: str, path: str | Path, targets: Mapping[str, TargetShape],
                 max_rank: int, dtype: torch.dtype,
                 experts: Mapping[str, ExpertShape] | None = None,
                 experts_refused: str = "this model has no experts") -> AdapterWeights:
    """The adapter at `path`, checked against `targets` (HF module path -> shape of each
    projection this model hooks; their last dotted part is the PEFT target name), `experts`
    (HF experts module path -> its sizes, the experts that take PEFT's `target_parameters`;
    none: such an adapter is refused saying `experts_refused`) and `max_rank`. Raises
    `LoraAdapterError`."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraAdapterError(f"adapter {name!r}: no folder at {folder}")
    config = _config(folder, name)
    _check_targets(config, name, {t.rsplit(".", 1)[-1] for t in targets})
    keys = _expert_keys(config, name, experts or {}, experts_refused)
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if not 1 <= rank <= max_rank:
        raise LoraAdapterError(f"adapter {name!r}: rank r={rank} is over max_lora_rank="
                               f"{max_rank}" if rank > max_rank else
                               f"adapter {name!r}: rank r={rank} must be at least 1")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise LoraAdapterError(f"adapter {name!r}: {weights} is missing")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as e:  # a truncated or foreign file: safetensors says what
        raise LoraAdapterError(f"adapter {name!r}: {weights} cannot be read: {e}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraAdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight")
        module, which = match.groups()
        if module not in targets and module not in keys:
            raise LoraAdapterError(f"adapter {name!r}: tensor {key!r} targets {module!r}, "
                                   "which this model has no LoRA-capable projection for")
        pairs.setdefault(module, {})[which] = tensor
    modules = {m: _checked_pair(name, m, p, targets[m], rank, scaling, dtype)
               for m, p in pairs.items() if m in targets}
    on_experts: dict[str, dict[str, ExpertPair]] = {}
    for key, (module, param) in keys.items():
        pair = pairs.get(key, {})
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"adapter {name!r}: {module}.{param} (target_parameters) "
                                   f"has no lora_A and lora_B under {key!r}")
        try:
            on_experts.setdefault(module, {})[param] = expert_pair(
                module, param, pair["A"], pair["B"], experts[module],  # type: ignore[index]
                rank, scaling, dtype)
        except ExpertLoraError as e:
            raise LoraAdapterError(f"adapter {name!r}: {e}") from None
    if not modules and not on_experts:
        raise LoraAdapterError(f"adapter {name!r}: {weights} holds no LoRA weights")
    return AdapterWeights(name, str(folder), rank, scaling, modules, on_experts)


def _expert_keys(config: dict, name: str, experts: Mapping[str, ExpertShape],
                 refused: str) -> dict[str, tuple[str, str]]:
    """Where the adapter's `target_parameters` pairs are saved -> (experts module, param)."""
    wanted = config.get("target_parameters") or []
    if not wanted:
        return {}
    if isinstance(wanted, str):
        raise LoraAdapterError(f"adapter {name!r}: target_parameters must be a list, got "
                               f"{wanted!r}")
    if not experts:
        raise LoraAdapterError(f"adapter {name!r}: target_parameters {wanted} in {CONFIG_FILE} "
                               f"(LoRA on an MoE's experts) not supported: {refused}")
    try:
        return expert_keys(wanted, experts)
    except ExpertLoraError as e:
        raise LoraAdapterError(f"adapter {name!r}: {e}") from None


def _checked_pair(name: str, module: str, pair: dict[str, torch.Tensor], shape: TargetShape,
                  rank: int, scaling: float, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    if set(pair) != {"A", "B"}:
        raise LoraAdapterError(f"adapter {name!r}: {module} has lora_{''.join(pair)} only; "
                               "both lora_A and lora_B are needed")
    a, b = pair["A"], pair["B"]
    for which, got, want in (("lora_A", a, (rank, shape.in_features)),
                             ("lora_B", b, (shape.out_features, rank))):
        if tuple(got.shape) != want:
            raise LoraAdapterError(
                f"adapter {name!r}: {module}.{which} has shape {list(got.shape)}, the base "
                f"model needs {list(want)} (rank {rank}); was it trained on another model?")
    # B scaled in fp32, then rounded once to the model's dtype
    return a.to(dtype), (b.float() * scaling).to(dtype)
