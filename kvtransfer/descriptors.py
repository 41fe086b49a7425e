"""The torch side of `kvtransfer.handoff`: KV dtype names to torch dtypes. The records themselves
live in `handoff`, which imports no torch so the router can carry them."""

from __future__ import annotations

import torch

from kvtransfer.errors import InvalidDescriptor
from kvtransfer.handoff import DTYPE_SIZES, KVLayout

# every transferable dtype name is the name of a torch dtype
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of `layout`'s cache tensors."""
    return DTYPES[layout.dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The `KVLayout.dtype` name of a torch dtype; raises `InvalidDescriptor` if not
    transferable."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise InvalidDescriptor(f"KV dtype {dtype} is not transferable; expected one of "
                            f"{sorted(DTYPES)}")
