"""Small layouts, caches of random bytes, and a block pool whose free count tests assert."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from kvtransfer import KVLayout
from kvtransfer.descriptors import torch_dtype


def make_layout(**overrides) -> KVLayout:
    base = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16")
    return dataclasses.replace(base, **overrides)


def random_caches(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Per-layer caches of random bit patterns (NaNs included: compare bytes, not values)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    itemsize = torch.empty((), dtype=torch_dtype(layout)).element_size()
    caches = []
    for _ in range(layout.num_layers):
        raw = torch.randint(0, 256, (*shape[:-1], layout.head_dim * itemsize), generator=gen,
                            dtype=torch.uint8)
        caches.append(raw.view(torch_dtype(layout)).contiguous())
    return caches


def zero_caches(layout: KVLayout, num_blocks: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return [torch.zeros(shape, dtype=torch_dtype(layout)) for _ in range(layout.num_layers)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def blocks_equal(src: Sequence[torch.Tensor], src_ids: Sequence[int],
                 dst: Sequence[torch.Tensor], dst_ids: Sequence[int],
                 src_heads: slice = slice(None), dst_heads: slice = slice(None)) -> bool:
    """Every layer's K and V of `src_ids` (heads `src_heads`) equal `dst_ids`, byte for byte."""
    si, di = torch.tensor(list(src_ids)), torch.tensor(list(dst_ids))
    return all(torch.equal(as_bytes(s[:, si][..., src_heads, :]),
                           as_bytes(d[:, di][..., dst_heads, :])) for s, d in zip(src, dst))


class BlockPool:
    """A free list of block ids, like the engine's, reduced to what a transfer test needs."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, *, scattered: bool = False) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} blocks wanted, {len(self._free)} free")
        ids = self._free[:2 * n:2] + self._free[1:2 * n:2] if scattered else self._free[:n]
        ids = ids[:n]
        taken = set(ids)
        self._free = [b for b in self._free if b not in taken]
        return ids

    def free(self, ids: Sequence[int]) -> None:
        taken = set(self._free)
        dup = [b for b in ids if b in taken]
        if dup:
            raise RuntimeError(f"blocks {dup} freed twice")
        self._free.extend(ids)
