"""Builds a model on its device and fills its parameters from safetensors files or a seeded RNG.

Checkpoints are read tensor by tensor with `safe_open` straight into the already-allocated
parameters, so peak memory is the model plus one checkpoint tensor.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from workers.attention.backend import AttentionBackend
from workers.models.checkpoint_shapes import random_weights
from workers.models import gguf_weights
from workers.models.fused_layer import use_fused_decoder_stack
from workers.models.model_config import ModelConfig
from workers.models.registry import get_model_class
from workers.models.layers import LINEAR_LAYERS, Shard, WeightShapeError
from workers.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from workers.models.vocab import ParallelLMHead, VocabParallelEmbedding
from workers.quant.decode import QuantizedTensorError, decode_checkpoint
from workers.quant import gguf_packed as gguf_packed_layers
from workers.quant.linear import prepare_layers, quantize_layers
from workers.quant.scheme import QuantScheme
from workers.kernels.small_gemm import use_small_batch_kernel, use_small_batch_mlp
from workers.tokenizer.gguf_file import GGUFError, find_gguf_file

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
    fp32_int_kernels: bool = False,
    gguf_packed: bool = True,
) -> LlamaForCausalLM:
    """Returns the model for `config` on `device` in `dtype`, in eval mode, weights loaded.

    `load_format`: "auto" reads `path`, a safetensors folder or a GGUF file (or a folder holding
    one: `workers.models.gguf_weights`); "safetensors" reads a folder's safetensors files;
    "dummy" ignores `path` and draws `random_weights(config, seed)` (what `make_model` writes).
    `shard` (overrides tp_rank/tp_size): the TP group, pipeline stage and expert split.
    `fp32_int_kernels`: in fp32, int8/int4 weights (a packed GGUF file's blocks too) stay
    packed for the VNNI kernels (`EngineConfig.fp32_int_kernels`). `gguf_packed`: a GGUF file's
    Q8_0/Q4_0/Q4_1 weights stay packed on the CPU (one rank), else dequantized at load.
    Raises WeightLoadError when the checkpoint does not fit; no half-loaded model escapes.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"unknown load_format {load_format!r}; expected one of {list(LOAD_FORMATS)}"
        )
    source = _weights_source(path, config, load_format)  # fails before allocating the model
    model_class = get_model_class(config.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config, attn_backend, shard=shard or Shard(tp_rank, tp_size))
    # "dummy" draws full-precision weights whatever the checkpoint's quantization
    scheme = config.quantization if load_format != "dummy" else None
    kept = quantize_layers(model, scheme, dtype, torch.device(device),
                           (*LINEAR_LAYERS, ParallelLMHead), fp32_int_kernels
                           ) if scheme is not None else set()
    error: str | None = None
    try:
        with torch.no_grad():
            if source is None:
                model.load_weights(random_weights(config, seed))
            elif isinstance(source, Path):
                packed = gguf_packed and torch.device(device).type == "cpu"
                _load_gguf(model, source, config, dtype if packed else None, fp32_int_kernels)
            else:
                _load_safetensors(model, source, Path(path), scheme, kept)  # type: ignore[arg-type]  # files: path set
    except WeightLoadError as e:
        error = str(e)
    if error is not None:
        # raised outside the except block so no traceback keeps the half-built model alive
        del model
        raise WeightLoadError(error)
    if kept:
        prepare_layers(model)
    use_cpu_kernels(model)
    return model.eval()


def use_cpu_kernels(model: LlamaForCausalLM) -> None:
    """The small-batch matmul and MLP kernels, then the fused decoder stack (which takes the
    layers whose matmuls and MLP carry their kernels), where they apply."""
    use_small_batch_kernel(model, (*LINEAR_LAYERS, ParallelLMHead))
    use_small_batch_mlp(model, (LlamaMLP,))
    use_fused_decoder_stack(model, LlamaModel, LlamaDecoderLayer, LlamaMLP)


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


def _load_safetensors(model: LlamaForCausalLM, files: list[Path], folder: Path,
                      scheme: QuantScheme | None = None, kept: set[str] | None = None) -> None:
    current: list[str] = ["", ""]  # (file, tensor) being read, for error messages

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 -- the handle is no mapping
                    current[:] = [file.name, name]
                    yield name, f.get_tensor(name)

    stream = tensors() if scheme is None else decode_checkpoint(tensors(), scheme, kept or set())
    try:
        loaded = model.load_weights(stream)
    except QuantizedTensorError as e:
        raise WeightLoadError(f"{str(folder)!r}: {e}") from None
    except WeightShapeError as e:
        raise WeightLoadError(f"{current[0]} in {str(folder)!r}: {e}") from None
    except KeyError as e:
        raise WeightLoadError(f"{str(folder)!r}: {e.args[0]}") from None
    _check_all_loaded(model, loaded, f"checkpoint {str(folder)!r}")


def _weights_source(path: str | Path | None, config: ModelConfig,
                    load_format: str) -> Path | list[Path] | None:
    """Where the weights come from: a GGUF file (checked against `config`), safetensors files,
    or None for "dummy" (seeded random weights)."""
    if load_format == "dummy":
        return None
    if path is None:
        raise ValueError(f"load_format {load_format!r} needs a model folder, got path=None")
    gguf_file = find_gguf_file(path) if load_format == "auto" else None
    if gguf_file is None:
        return find_safetensors_files(Path(path))
    try:
        gguf_weights.check_tensors(gguf_file, config)
    except GGUFError as e:
        raise WeightLoadError(str(e)) from None
    return gguf_file


def _load_gguf(model: LlamaForCausalLM, file: Path, config: ModelConfig,
               packed_dtype: torch.dtype | None, int_kernels: bool = False) -> None:
    """`packed_dtype`: the model's dtype, when Q8_0/Q4_0/Q4_1 weights stay packed; None:
    every tensor dequantized. `int_kernels` (fp32): the packed layers then move to the VNNI
    kernel (`gguf_packed.use_int_kernels`)."""
    try:
        packed = set() if packed_dtype is None else gguf_weights.keep_packed(
            model, file, config, packed_dtype, (*LINEAR_LAYERS, VocabParallelEmbedding))
        loaded = model.load_weights(gguf_weights.checkpoint_tensors(file, config, packed))
    except (GGUFError, WeightShapeError, KeyError) as e:
        raise WeightLoadError(f"GGUF file {str(file)!r}: {e.args[0]}") from None
    _check_all_loaded(model, loaded, f"GGUF file {str(file)!r}")
    if int_kernels and packed_dtype == torch.float32:
        gguf_packed_layers.use_int_kernels(model)


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
