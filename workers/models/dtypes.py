"""Dtype names as users write them ("bf16", "auto") mapped to torch dtypes."""

from __future__ import annotations

from typing import Protocol

import torch


class _Checkpoint(Protocol):
    @property
    def torch_dtype(self) -> str | None:
        """The checkpoint's own dtype name, None if unstated."""

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


def resolve_dtype(name_or_dtype: str | torch.dtype, config: _Checkpoint) -> torch.dtype:
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
