"""How many splits a paged decode uses per sequence, and the scratch their partial outputs go
to. Plain torch: the Triton decode kernel (`triton_decode`) launches what this plans, and a
CUDA-graph runner sizes its scratch from it once."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

# Splitting a sequence costs a partial-output write per split and a merge launch; below this many
# tokens per split the extra parallelism does not pay for that (about 4 tiles per split).
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16


class DecodeScratch(NamedTuple):
    """fp32 buffers for split partials, flat so that one scratch serves every batch and split
    count whose product fits: B sequences x S splits use the first B * S rows. Layers run one
    after another, so every layer (and every captured graph) can share one."""

    partial_out: torch.Tensor  # [rows, num_heads, head_dim] fp32
    lse: torch.Tensor  # [rows, num_heads] fp32, base-2 log-sum-exp

    @classmethod
    def allocate(cls, rows: int, num_heads: int, head_dim: int,
                 device: torch.device | str) -> DecodeScratch:
        """`rows`: the largest batch x num_splits to serve (see `max_split_rows`)."""
        return cls(torch.empty(rows, num_heads, head_dim, dtype=torch.float32, device=device),
                   torch.empty(rows, num_heads, dtype=torch.float32, device=device))

    def fits(self, batch: int, num_heads: int, head_dim: int, num_splits: int) -> bool:
        rows, h, d = self.partial_out.shape
        return batch * num_splits <= rows and num_heads == h and head_dim == d

    def views(self, batch: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, Hq, S, D] partial outputs, [B, Hq, S] lse) over the first B * S rows."""
        _, num_heads, head_dim = self.partial_out.shape
        n = batch * num_heads * num_splits
        return (self.partial_out.view(-1)[:n * head_dim].view(batch, num_heads, num_splits,
                                                              head_dim),
                self.lse.view(-1)[:n].view(batch, num_heads, num_splits))


@functools.cache
def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (splitting gains nothing there)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int,
                      num_sms: int = 132) -> int:
    """Splits per sequence for a decode batch: enough programs to fill the GPU's `num_sms`
    (the default is an H100 SXM's) when batch x KV heads alone does not, while keeping at least
    MIN_TOKENS_PER_SPLIT tokens per split. A power of two from 1 to MAX_SPLITS, so a CUDA-graph
    runner captures few variants. A runner should pass the longest length a graph may replay
    with (e.g. max_model_len); the kernel leaves splits past a shorter sequence's end empty."""
    if batch < 1 or num_kv_heads < 1 or num_sms < 1:
        raise ValueError(f"batch, num_kv_heads and num_sms must be positive, got {batch}, "
                         f"{num_kv_heads}, {num_sms}")
    programs = batch * num_kv_heads
    if programs >= num_sms:
        return 1  # one full wave already; splitting would only add partial writes
    splits = min(-(-num_sms // programs), max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return 1 << (max(splits, 1).bit_length() - 1)


def decode_launches(num_splits: int) -> int:
    """Kernels one paged decode attention launches per layer and step: the split kernel, and the
    merge of the splits' partials when there is more than one (a CUDA graph replays both)."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    return 1 if num_splits == 1 else 2


def max_split_rows(num_kv_heads: int, num_sms: int) -> int:
    """The most batch x num_splits rows `choose_num_splits` asks for at any batch and length:
    a scratch of this many rows never has to grow (under 2 * num_sms / num_kv_heads, since
    splitting stops once batch x KV heads fills the SMs)."""
    longest = MAX_SPLITS * MIN_TOKENS_PER_SPLIT
    return max(batch * choose_num_splits(batch, num_kv_heads, longest, num_sms)
               for batch in range(1, -(-num_sms // num_kv_heads) + 1))
