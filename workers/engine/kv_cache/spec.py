"""The shape of a worker's KV cache: what the runner allocates and the executors shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.kernels.kv_quant import storage_head_dim


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    latent: bool = False  # one latent per token serving as key and value (MLA), replicated on TP

    @property
    def planes(self) -> int:
        """The cache's leading dimension: keys and values (2), or the latent (1)."""
        return 1 if self.latent else 2

    @property
    def cache_head_dim(self) -> int:
        """The cache's last dimension: `head_dim`, plus an 8-bit cache's scale bytes."""
        return storage_head_dim(self.head_dim, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, keys and values (or the latent)."""
        return (self.planes * self.num_layers * self.block_size * self.num_kv_heads
                * self.cache_head_dim * torch.empty((), dtype=self.dtype).element_size())
