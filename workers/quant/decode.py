"""Reads a quantized checkpoint's tensors into what the model's layers load.

Each quantized module's tensors are gathered until all of its parts have come (they may sit in
different files), then decoded. Modules whose layer kept a quantized kernel get `qweight`,
`scales` and `zeros` in Cleave's form (`workers.quant.weights.IntWeight`); every other
quantized module is dequantized to a full-precision `weight`, so any layer (mixture-of-experts
experts, an output projection, a layer on a device without a kernel) loads it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from workers.quant.formats import IGNORED_PARTS, decode, required_parts
from workers.quant.scheme import QuantScheme
from workers.quant.weights import FP8, IntWeight

_QUANTIZED_DTYPES = (FP8, torch.int8)


class QuantizedTensorError(ValueError):
    """A quantized module whose tensors are missing or do not fit together."""


def decode_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]], scheme: QuantScheme, kept: set[str],
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs -> the pairs the model loads (see the module doc)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix == "weight" and tensor.dtype not in _QUANTIZED_DTYPES:
            yield name, tensor  # a full-precision tensor (norms, embeddings, skipped modules)
            continue
        module_scheme = scheme.for_module(prefix)  # the output projection's may differ
        required = required_parts(module_scheme)
        if suffix not in required:
            if suffix in IGNORED_PARTS:
                continue
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        if all(part in parts for part in required):
            del pending[prefix]
            yield from _emit(module_scheme, prefix, parts, prefix in kept)
    if pending:
        prefix, parts = next(iter(pending.items()))
        module_scheme = scheme.for_module(prefix)
        required = required_parts(module_scheme)
        missing = [p for p in required if p not in parts]
        raise QuantizedTensorError(
            f"quantized module {prefix!r} lacks tensors {missing} "
            f"({module_scheme.describe()} needs {list(required)}); {len(pending)} module(s) "
            "incomplete")


def _emit(scheme: QuantScheme, prefix: str, parts: dict[str, torch.Tensor], kept: bool
          ) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        weight = decode(scheme, parts)
    except (ValueError, RuntimeError, IndexError) as e:
        shapes = {k: list(v.shape) for k, v in parts.items()}
        raise QuantizedTensorError(f"quantized module {prefix!r} ({scheme.describe()}, "
                                   f"tensors {shapes}): {e}") from None
    if kept:
        assert isinstance(weight, IntWeight)
        yield f"{prefix}.qweight", weight.q
        yield f"{prefix}.scales", weight.scales
        yield f"{prefix}.zeros", weight.zeros
    else:
        yield f"{prefix}.weight", weight.dequantize(torch.float32)
