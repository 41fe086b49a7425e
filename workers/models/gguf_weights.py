"""A GGUF file's tensors as the Hugging Face checkpoint's, for `load_weights`.

Names are mapped with the `gguf` package's own table (`gguf.get_tensor_name_map`, the one
llama.cpp's converter writes with), and the converter's transforms are undone: the llama
family's q/k rows come back from llama.cpp's RoPE layout (`hf_row_order`), Gemma's norms lose
the one added to them. Quantized blocks are dequantized once, tensor by tensor, to fp32
(`gguf.quants.dequantize`); `load_weights` casts each into the model's dtype.

`raw_tensors` yields every tensor with its GGML type and its blocks as the file stores them.
On the CPU (`EngineConfig.gguf_packed`), `keep_packed` gives the layers whose tensors are all
Q8_0, Q4_0 or Q4_1 packed weights (`workers.quant.gguf_packed`) before the file is read, and
`checkpoint_tensors(..., packed)` yields those tensors' blocks as uint8 rows [rows, row bytes] (rows
reorder blocks whole, so `hf_row_order` applies to packed rows too), the rest dequantized.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from workers.models.checkpoint_shapes import hf_weight_shapes
from workers.models.gguf_config import ROPE_FREQS, GGUFFamily, family_of, tensor_infos
from workers.models.model_config import ModelConfig
from workers.quant import gguf_packed
from workers.quant.linear import QuantizableModel, checkpoint_names
from workers.tokenizer.gguf_file import GGUFError, GGUFMetadata, open_gguf

# the GGML types the dequantized path reads (others are refused before the model is built)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q4_K", "Q5_K", "Q6_K")
_SKIPPED = (ROPE_FREQS,)  # read into the config's RoPE settings (`gguf_config`)


class RawGGUFTensor(NamedTuple):
    """One checkpoint tensor as the file stores it."""

    gguf_name: str  # "blk.0.attn_q.weight"
    hf_name: str  # "model.layers.0.self_attn.q_proj.weight"
    ggml_type: str  # "Q8_0", "F32", ...
    shape: tuple[int, ...]  # HF order ([out, in]); the values' shape once dequantized
    data: np.ndarray  # memory-mapped; quantized types: uint8 [rows, bytes per row]
    row_order: np.ndarray | None  # HF row i is the file's row row_order[i]; None: the same


def hf_names(config: ModelConfig, family: GGUFFamily, arch: str) -> dict[str, str]:
    """GGUF tensor name -> HF name, for every tensor of `config`'s HF checkpoint."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    table = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    names: dict[str, str] = {}
    for hf_name, _ in hf_weight_shapes(config):
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = table.get_name(base)
        if gguf_base is None:
            raise GGUFError(f"{family.architecture}: no GGUF name for tensor {hf_name!r}")
        names[f"{gguf_base}.{suffix}"] = hf_name
    return names


def hf_row_order(hf_name: str, config: ModelConfig, family: GGUFFamily) -> np.ndarray | None:
    """Rows of the file's tensor in HF order: llama.cpp stores each head's q/k rows of the
    llama family with the two rotated halves interleaved ([h, d/2, 2] where HF has [h, 2, d/2])."""
    if not family.permuted_qk or not any(
            f".self_attn.{p}." in hf_name for p in ("q_proj", "k_proj")):
        return None
    heads = (config.num_attention_heads if ".q_proj." in hf_name
             else config.num_key_value_heads)
    d = config.head_dim
    file_rows = np.arange(heads * d).reshape(heads, d // 2, 2)
    return file_rows.transpose(0, 2, 1).reshape(-1)


def check_tensors(path: str | Path, config: ModelConfig) -> None:
    """Raises GGUFError (before any model is built) naming tensors of unsupported types,
    tensors with no place in the model, and those the model needs but the file lacks."""
    reader = open_gguf(path)
    meta = GGUFMetadata(reader, Path(path))
    infos = tensor_infos(reader)
    bad = sorted({f"{t.name}: {t.ggml_type}" for t in infos.values()
                  if t.ggml_type not in SUPPORTED_TYPES})
    if bad:
        raise GGUFError(f"GGUF file {str(path)!r} has tensors of unsupported types {bad[:5]}; "
                        f"supported: {list(SUPPORTED_TYPES)}")
    names = hf_names(config, family_of(meta), meta.architecture)
    unknown = sorted(set(infos) - set(names) - set(_SKIPPED))
    missing = sorted(set(names) - set(infos))
    if unknown or missing:
        raise GGUFError(f"GGUF file {str(path)!r} does not fit a {config.architecture}: "
                        f"tensors without a place {unknown[:5]}, tensors missing {missing[:5]}")


def raw_tensors(path: str | Path, config: ModelConfig) -> Iterator[RawGGUFTensor]:
    """Every checkpoint tensor of the file, blocks untouched, in the file's order."""
    reader = open_gguf(path)
    meta = GGUFMetadata(reader, Path(path))
    family = family_of(meta)
    names = hf_names(config, family, meta.architecture)
    infos = tensor_infos(reader)
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED:
            continue
        hf_name = names.get(tensor.name)
        if hf_name is None:
            raise GGUFError(f"GGUF file {str(path)!r}: tensor {tensor.name!r} has no place "
                            f"in a {config.architecture}")
        yield RawGGUFTensor(tensor.name, hf_name, tensor.tensor_type.name,
                            infos[tensor.name].shape, tensor.data,
                            hf_row_order(hf_name, config, family))


def keep_packed(model: QuantizableModel, path: str | Path, config: ModelConfig,
                dtype: torch.dtype, layer_types: tuple[type, ...]) -> set[str]:
    """Gives every layer of `layer_types` in `model` (linear layers, vocabulary tables) whose
    checkpoint tensors in the file are all of one packed type (`gguf_packed.PACKED_TYPES`) a
    packed weight (`gguf_packed.pack_layer`), and a tied output projection its embedding's.
    Returns the HF names of the tensors to load as blocks (`checkpoint_tensors`' `packed`)."""
    reader = open_gguf(path)
    meta = GGUFMetadata(reader, Path(path))
    names = hf_names(config, family_of(meta), meta.architecture)
    types = {names[name]: info.ggml_type for name, info in tensor_infos(reader).items()
             if name in names}
    kept: set[str] = set()
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if not isinstance(module, layer_types):
            continue
        parts = [f"{part}.weight" for part in checkpoint_names(model, name)]
        kinds = {types.get(part) for part in parts}
        if len(kinds) != 1:
            continue
        (kind,) = kinds
        if kind is None or not gguf_packed.packable(module, kind):
            continue
        gguf_packed.pack_layer(module, kind, dtype)
        kept.update(parts)
    lm_head, embedding = modules.get("lm_head"), modules.get("model.embed_tokens")
    if getattr(lm_head, "tied", False) and "model.embed_tokens.weight" in kept:
        gguf_packed.tie_packed(lm_head, embedding)
    return kept


def checkpoint_tensors(path: str | Path, config: ModelConfig, packed: Collection[str] = ()
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every checkpoint tensor, one at a time: those named in
    `packed` as their blocks, uint8 [rows, row bytes] in HF row order; the others fp32, the
    values the file stores, as the HF checkpoint it was converted from holds them."""
    import gguf

    family = family_of(GGUFMetadata(open_gguf(path), Path(path)))
    for raw in raw_tensors(path, config):
        if raw.hf_name in packed:
            if raw.ggml_type not in gguf_packed.PACKED_TYPES:
                raise GGUFError(f"tensor {raw.gguf_name!r} is {raw.ggml_type}, not a packed "
                                f"type {list(gguf_packed.PACKED_TYPES)}")
            blocks = np.asarray(raw.data, dtype=np.uint8)
            blocks = blocks[raw.row_order] if raw.row_order is not None else blocks.copy()
            yield raw.hf_name, torch.from_numpy(blocks)
            continue
        values = gguf.quants.dequantize(raw.data, gguf.GGMLQuantizationType[raw.ggml_type])
        values = np.array(values, dtype=np.float32).reshape(raw.shape)  # a copy: writable
        if raw.row_order is not None:
            values = values[raw.row_order]
        if family.norm_offset and raw.hf_name.endswith("norm.weight"):
            values -= np.float32(family.norm_offset)
        yield raw.hf_name, torch.from_numpy(values)

