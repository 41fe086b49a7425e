"""The host tier's tensors beside one holder's KV caches, and the copies between the two.

Whoever owns a set of device caches (an in-process executor, or each rank of a group: its own
layers and heads) owns their host tier too, and makes the step's copies (`BlockCopies`, planned
by `workers.engine.kv_cache.host_tier`) before its forward pass: saves first, then loads. Blocks are
copied as bytes, so 8-bit caches (int8, fp8 with their scale bytes) move exactly.

On a GPU the host tensors are pinned: loads are asynchronous copies on the compute stream,
ordered before the kernels that read them. Saves wait for their copy (the host tensor must hold
the bytes before a later step may overwrite the device block); GPU figures are unmeasured.
"""

from __future__ import annotations

import torch

from workers.engine.kv_cache import host_memory
from workers.engine.kv_cache.host_tier import BlockCopies


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as bytes (its last dimension scaled by the element size)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class HostCaches:
    """Per layer a host tensor shaped like `device_caches[layer]` with `num_blocks` blocks
    (dimension 1)."""

    def __init__(self, device_caches: list[torch.Tensor], num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least 1 block, got {num_blocks}")
        self.device_caches = device_caches
        self.num_blocks = num_blocks
        self.tensors: list[torch.Tensor] = []
        for cache in device_caches:
            shape = (cache.shape[0], num_blocks, *cache.shape[2:])
            if cache.device.type == "cuda":
                self.tensors.append(torch.zeros(shape, dtype=cache.dtype, pin_memory=True))
            else:
                self.tensors.append(host_memory.zeros(shape, cache.dtype, torch.device("cpu")))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def apply(self, copies: BlockCopies) -> None:
        """Make one step's copies: every save, then every load."""
        if copies.swap_out:
            src, dst = _indices(copies.swap_out, self.device_caches[0].device)
            for cache, host in zip(self.device_caches, self.tensors):
                moved = _bytes(cache).index_select(1, src).cpu()
                _bytes(host).index_copy_(1, dst.cpu(), moved)
        if copies.swap_in:
            src, dst = _indices(copies.swap_in, self.device_caches[0].device)
            for cache, host in zip(self.device_caches, self.tensors):
                moved = _bytes(host).index_select(1, src.cpu())
                _bytes(cache).index_copy_(1, dst, moved.to(cache.device, non_blocking=True))


def _indices(pairs: tuple[tuple[int, int], ...],
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sources, destinations) of the pairs as index tensors on `device`."""
    both = torch.tensor(pairs, dtype=torch.int64).T
    return both[0].to(device), both[1].to(device)
