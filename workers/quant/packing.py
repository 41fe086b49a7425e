"""Integers of 4 or 8 bits packed into int32 words, in the orders the hub's formats use.

A word holds `32 // bits` values along the last dimension, the first in the lowest bits (GPTQ,
compressed-tensors). AWQ packs its eight 4-bit values in the interleaved order below: the value
of output column `AWQ_ORDER[i]` of each group of eight sits in nibble `i`.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_int32(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
               ) -> torch.Tensor:
    """[..., n] unsigned values < 2**bits -> [..., n * bits / 32] int32 words."""
    per_word = 32 // bits
    if values.shape[-1] % per_word:
        raise ValueError(f"cannot pack {values.shape[-1]} values into int32 words of "
                         f"{per_word}; expected a multiple of {per_word}")
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    if order is not None:
        grouped = grouped[..., list(order)]
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (grouped << shifts).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement wrap


def unpack_int32(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None
                 ) -> torch.Tensor:
    """[..., w] int32 words -> [..., w * 32 / bits] unsigned values (int32)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        inverse = [0] * per_word
        for nibble, column in enumerate(order):
            inverse[column] = nibble
        values = values[..., inverse]
    return values.reshape(*words.shape[:-1], -1)
