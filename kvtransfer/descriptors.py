"""The torch side of `kvtransfer.handoff`: the torch dtype of each KV dtype name. The records
themselves live in `handoff`, which imports no torch so the router can carry them."""

from __future__ import annotations

import torch

from kvtransfer.handoff import DTYPE_SIZES, KVLayout

# every transferable dtype name is the name of a torch dtype
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype of `layout`'s cache tensors."""
    return DTYPES[layout.dtype]
