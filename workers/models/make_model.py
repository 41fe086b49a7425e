"""Synthetic but real checkpoints: HF config, seeded safetensors weights and a trained tokenizer.

`make_model` writes a folder that both Cleave and `transformers.AutoModelForCausalLM` load. The
weights are `workers.models.loader.random_weights(config, seed)`, so `load_format="dummy"` with the
same seed gives the same model without touching disk. `default_model_path()` is the embedded default
every test and `cleave generate` uses when no model is named.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from workers.models.checkpoint_shapes import hf_weight_shapes, random_weight
from workers.models.kit_configs import ARCHITECTURES, TOKENIZER_FAMILY, PRESETS, hf_config
from workers.models.dtypes import resolve_dtype
from workers.models.model_config import ModelConfig

# bump when the files make_model writes change, so cached defaults are rebuilt
_FORMAT_VERSION = 2  # 2: chat templates that render tools (llama, mistral)
_DEFAULT_SHARD_BYTES = 2 * 1024**3
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
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHITECTURES)}")
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

    tokenizer = write_tokenizer_files(out, arch=TOKENIZER_FAMILY.get(arch, arch),
                                      vocab_size=shape.vocab_size)
    config_object = hf_config(arch, preset, shape, tokenizer, overrides or {})
    config_object.save_pretrained(out)  # config.json
    _generation_config(config_object).save_pretrained(out)  # generation_config.json
    if weights:
        config = ModelConfig.from_pretrained(out)
        _write_weights(out, config, seed, resolve_dtype("auto", config), max_shard_bytes)
    return out


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
